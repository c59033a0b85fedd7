"""The ALFWorld engine session and the constants shared by the environment and the game generator.

Owns ``AlfredEngine`` (one TextWorld PDDL game session with ALFWorld's name demangler), the process-wide
engine lock and PDDL translation cache it needs, and the names of an ALFWorld ``json_2.1.1`` tree. Both
``jaxopd_envs.alfworld`` (which plays games) and ``jaxopd_envs.alfworld_gen`` (which writes and verifies them) import
it; it imports neither. Importing it needs only the standard library: TextWorld is loaded by the first
``AlfredEngine``.
"""
from __future__ import annotations

import collections
import hashlib
import os
import sys
import threading
from typing import Any, Mapping

from jaxopd_envs.base import EnvError
from jaxopd_envs.alfworld_import import import_alfworld

BENCHMARK = "alfworld"
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
ALFWORLD_SPLITS = ("train", "valid_seen", "valid_unseen")
GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
INDEX_FILE = "index.json"          # written by jaxopd_envs.alfworld_gen; lists the games of a generated tree
DATA_SUBDIR = "json_2.1.1"         # the official release keeps its splits under this folder
REFUSED_FEEDBACK = "Nothing happens."
"""The engine's answer to a command it does not execute (alfworld 0.4), and ``AlfWorldEnv``'s to one outside the
admissible set."""

_EXCLUDED_COMMANDS = frozenset({"help"})

# fast_downward.pddl2sas (run twice by PddlEnv.load and twice again by PddlEnv.reset) swaps sys.stdout,
# overwrites sys.argv and flips module-level translator options between its passes: two threads translating
# at once corrupt each other. It is also a pure function of its text inputs and the costliest part of a
# reset (about 1 s per pass for a kitchen). ``_install_translation_cache`` replaces it, process-wide, with a
# serialised and memoised version, so resetting a loaded game translates nothing.
_TRANSLATION_LOCK = threading.Lock()
# TextWorld's PDDL engine is not thread-safe either: the PDDL-logic and text-grammar parsers are
# module-level tatsu parser objects with internal state, used by load and by every step (each admissible
# command and feedback is derived through the grammar), and concurrent loading of libdownward copies
# crashed the process here. Every engine call therefore holds this lock. It costs little: the engine's work
# is pure Python (tatsu parsing, deepcopy), so threads could not overlap it under the GIL anyway. For
# parallel speed ALFWorld runs in worker processes, each with its own lock (``jaxopd_envs.pool``'s process backend).
ENGINE_LOCK = threading.RLock()
TRANSLATION_CACHE_SIZE = 32          # (problem, pass) entries; a kitchen game holds about 3.5 MB
_translations: "collections.OrderedDict[tuple[str, bool], Any]" = collections.OrderedDict()


def _install_translation_cache() -> None:
    import fast_downward

    if getattr(fast_downward.pddl2sas, "_jaxopd_cached", False):
        return
    original = fast_downward.pddl2sas

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        key = (hashlib.sha256(f"{domain}\0{problem}".encode()).hexdigest(), bool(optimize))
        with _TRANSLATION_LOCK:
            if key in _translations:
                _translations.move_to_end(key)
                return _translations[key]
            saved_argv, saved_stdout = list(sys.argv), sys.stdout
            try:
                result = original(domain, problem, verbose=verbose, optimize=optimize)
            finally:
                sys.argv[:] = saved_argv
                sys.stdout = saved_stdout
            _translations[key] = result
            while len(_translations) > TRANSLATION_CACHE_SIZE:
                _translations.popitem(last=False)
            return result

    pddl2sas._jaxopd_cached = True
    fast_downward.pddl2sas = pddl2sas


class AlfredEngine:
    """One TextWorld PDDL game session with ALFWorld's demangled object names ("cabinet 3").

    One thread drives one engine. Engines in different threads are safe but take turns (see
    ``ENGINE_LOCK``); PDDL translation is memoised process-wide. Engine failures surface as ``EnvError``.
    """

    def __init__(self, *, expert_plan: bool = False, facts: bool = False) -> None:
        try:
            import_alfworld()
            import textworld
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
            from textworld.envs import PddlEnv
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError("ALFWorld needs `pip install alfworld==0.4.2 textworld==1.7.0`") from exc
        # ``facts`` (the true state's predicates) are for scripted experts only, never shown to an agent
        self._infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=expert_plan,
                                         facts=facts, extras=["gamefile"])
        try:
            with ENGINE_LOCK:
                self._pddl_env = PddlEnv(self._infos)
        except Exception as exc:
            raise EnvError(f"cannot start the TextWorld PDDL engine: {exc!r}") from exc
        self._env = AlfredInfos(AlfredDemangler(self._pddl_env, shuffle=False))
        _install_translation_cache()
        self._closed = False

    @property
    def expert_plan(self) -> bool:
        return bool(self._infos.policy_commands)

    @expert_plan.setter
    def expert_plan(self, value: bool) -> None:
        """Whether ``policy_commands`` (the planner's plan from the current state) is computed each step."""
        self._infos.policy_commands = bool(value)

    def load(self, game: str | os.PathLike | Mapping[str, Any]) -> None:
        """Load a game file path, or the decoded JSON of one (keys pddl_domain, grammar, pddl_problem)."""
        self._check_open()
        source = os.fspath(game) if isinstance(game, (str, os.PathLike)) else dict(game)
        try:
            with ENGINE_LOCK:
                self._env.load(source)
        except Exception as exc:
            raise EnvError(f"cannot load ALFWorld game {_describe(game)}: {exc!r}") from exc

    def reset(self):
        self._check_open()
        try:
            with ENGINE_LOCK:
                return self._env.reset()
        except Exception as exc:
            raise EnvError(f"ALFWorld reset failed: {exc!r}") from exc

    def step(self, command: str):
        """Returns (game_state, score, done) as TextWorld does."""
        self._check_open()
        try:
            with ENGINE_LOCK:
                return self._env.step(command)
        except Exception as exc:
            raise EnvError(f"ALFWorld step {command!r} failed: {exc!r}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        lib = getattr(self._pddl_env, "downward_lib", None)
        if lib is not None:
            # Free the engine's task state but never dlclose its copy of libdownward.so: the copies share
            # C++ static registries, and unloading one leaves destructors that crash the interpreter at exit
            # (SIGSEGV in options::RawRegistry::~RawRegistry). A closed engine keeps a few MB mapped.
            try:
                with ENGINE_LOCK:
                    lib.cleanup()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
            self._pddl_env.downward_lib = None

    def _check_open(self) -> None:
        if self._closed:
            raise EnvError("the ALFWorld engine is closed")


def _describe(game: Any) -> str:
    return repr(os.fspath(game)) if isinstance(game, (str, os.PathLike)) else "<in-memory game>"


def admissible_actions(game_state: Mapping[str, Any]) -> tuple[str, ...]:
    """The engine's admissible commands, sorted, without ``help``."""
    return tuple(c for c in game_state["admissible_commands"] if c not in _EXCLUDED_COMMANDS)
