"""ALFWorld on its real text engine (TextWorld's PDDL environment with alfworld's name demangler).

Owns game discovery in an ALFWorld ``json_2.1.1`` tree (the official release under ``$ALFWORLD_DATA`` or
one written by ``jaxopd_envs.alfworld_gen``) and ``AlfWorldEnv``, the ``TextEnv`` that plays those games. The
engine session and the tree's names live in ``jaxopd_envs.alfworld_engine`` (re-exported here); importing this
module needs only the standard library.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from jaxopd_envs.alfworld_engine import (
    ALFWORLD_SPLITS,
    BENCHMARK,
    DATA_SUBDIR,
    ENGINE_LOCK,
    GAME_FILE,
    INDEX_FILE,
    REFUSED_FEEDBACK,
    TASK_TYPES,
    TRAJ_FILE,
    AlfredEngine,
    admissible_actions,
)
from jaxopd_envs.base import EnvError, Observation, Task, TextEnv, require_int
from jaxopd_envs.checks import normalize_action

__all__ = ["BENCHMARK", "TASK_TYPES", "ALFWORLD_SPLITS", "GAME_FILE", "TRAJ_FILE", "INDEX_FILE", "DATA_SUBDIR",
           "AlfredEngine", "admissible_actions", "NoGamesError", "GameRecord", "AlfWorldEnv", "split_intro",
           "data_dir_of", "discover_games", "official_data_root", "read_walkthrough", "REFUSED_FEEDBACK"]

_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_LINE = re.compile(r"^\s*(Your task is to:.*?)\s*$", re.MULTILINE)


class NoGamesError(ValueError):
    """No playable ALFWorld game was found where one was asked for."""


def split_intro(feedback: str) -> tuple[str, str]:
    """Split the reset feedback into (observation text, "Your task is to: ..." instruction)."""
    match = _TASK_LINE.search(feedback)
    if match is None:
        raise EnvError(f"ALFWorld intro has no 'Your task is to:' line: {feedback[:200]!r}")
    instruction = match.group(1)
    text = (feedback[:match.start()] + feedback[match.end():]).replace(_BANNER, "")
    return text.strip(), instruction


# --------------------------------------------------------------------------------------------- games


@dataclasses.dataclass(frozen=True)
class GameRecord:
    """One playable game of a json_2.1.1 tree."""

    split: str
    relative_dir: str        # "<task folder>/<trial folder>" below the split folder
    task_type: str
    game_file: str           # absolute path of game.tw-pddl

    @property
    def task_id(self) -> str:
        return f"{BENCHMARK}/{self.split}/{self.relative_dir}"

    def as_task(self) -> Task:
        return Task(benchmark=BENCHMARK, split=self.split, task_id=self.task_id, task_type=self.task_type,
                    payload={"game_file": self.game_file})


def data_dir_of(root: str | os.PathLike) -> Path:
    """The folder holding the split folders: ``root/json_2.1.1`` when it exists, else ``root`` itself."""
    root = Path(root).expanduser()
    return root / DATA_SUBDIR if (root / DATA_SUBDIR).is_dir() else root


def discover_games(root: str | os.PathLike, split: str) -> list[GameRecord]:
    """Solvable games of the six task types in ``split`` of an ALFWorld tree, sorted by task id.

    Follows the official loader (``AlfredTWEnv.collect_game_files``): a game is a folder with
    ``traj_data.json`` and a ``game.tw-pddl`` marked solvable; movable-receptacle and sliced tasks are
    skipped. A tree written by ``jaxopd_envs.alfworld_gen`` carries an index that is read instead of the files.
    """
    if split not in ALFWORLD_SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {ALFWORLD_SPLITS}")
    data_dir = data_dir_of(root)
    index_path = Path(root).expanduser() / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        records = [GameRecord(split=g["split"], relative_dir=g["relative_dir"], task_type=g["task_type"],
                              game_file=str(data_dir / g["split"] / g["relative_dir"] / GAME_FILE))
                   for g in index["games"] if g["split"] == split]
        return sorted(records, key=lambda r: r.relative_dir)

    split_dir = data_dir / split
    records = []
    if not split_dir.is_dir():
        return records
    for traj_path in sorted(split_dir.rglob(TRAJ_FILE)):
        game_dir = traj_path.parent
        relative_dir = game_dir.relative_to(split_dir).as_posix()
        if "movable" in relative_dir or "Sliced" in relative_dir:
            continue
        game_path = game_dir / GAME_FILE
        if not game_path.is_file():
            continue
        try:
            task_type = json.loads(traj_path.read_text())["task_type"]
            solvable = json.loads(game_path.read_text()).get("solvable")
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"unreadable ALFWorld game in {game_dir}: {exc!r}") from exc
        if task_type in TASK_TYPES and solvable:
            records.append(GameRecord(split=split, relative_dir=relative_dir, task_type=task_type,
                                      game_file=str(game_path)))
    return records


def official_data_root() -> Path | None:
    """``$ALFWORLD_DATA`` when it holds an official json_2.1.1 tree, else None."""
    value = os.environ.get("ALFWORLD_DATA")
    if not value:
        return None
    root = Path(value).expanduser()
    return root if (root / DATA_SUBDIR).is_dir() else None


def read_walkthrough(game_file: str | os.PathLike) -> list[str] | None:
    """The walkthrough stored in a game file (written by ``alfworld-generate`` or our generator), if any."""
    data = json.loads(Path(game_file).read_text())
    walkthrough = data.get("walkthrough")
    return list(walkthrough) if walkthrough else None


# ----------------------------------------------------------------------------------------------- env


class AlfWorldEnv(TextEnv):
    """ALFWorld games behind ``TextEnv``.

    ``game_root`` is a folder holding ``json_2.1.1/{train,valid_seen,valid_unseen}`` (the official release,
    e.g. ``$ALFWORLD_DATA``) or a tree written by ``jaxopd_envs.alfworld_gen``. Without it: ``$ALFWORLD_DATA``
    when it holds the official games, else the generator's cached games (generated on first use).
    ``source`` says which one is in use ("official" or "generated").

    Observations: ``text`` is the engine's feedback (the intro without its banner and task line at reset),
    ``instruction`` the "Your task is to: ..." line, ``admissible_actions`` the engine's commands without
    ``help``, ``score`` 1.0 once won. An action outside the admissible set (compared after NFKC, case
    folding and whitespace collapse) is not sent to the engine: it costs a turn and yields
    "Nothing happens." as the engine itself answers. ``max_turns`` (optional) ends an episode after that
    many actions with ``info["truncated"]``.
    """

    benchmark = BENCHMARK
    # TextWorld's engine holds one process-wide lock (``ENGINE_LOCK``) in every call: instances in threads
    # take turns, so ``EnvPool`` runs ALFWorld in worker processes unless told otherwise.
    pool_backend = "process"
    call_lock = ENGINE_LOCK

    def __init__(self, game_root: str | os.PathLike | None = None, *, expert_plan: bool = False,
                 max_turns: int | None = None, generator_seed: int = 0) -> None:
        if max_turns is not None:
            max_turns = require_int(max_turns, "max_turns", minimum=1)
        if game_root is None:
            official = official_data_root()
            if official is not None:
                game_root, self.source = official, "official"
            else:
                from jaxopd_envs import alfworld_gen  # lazy: generation needs numpy and the alfworld data
                game_root, self.source = alfworld_gen.ensure_games(seed=generator_seed), "generated"
        else:
            game_root = Path(game_root).expanduser()
            if not game_root.is_dir():
                raise NoGamesError(f"ALFWorld game root {str(game_root)!r} does not exist")
            self.source = "generated" if (game_root / INDEX_FILE).is_file() else "official"
        self.game_root = Path(game_root)
        self.max_turns = max_turns
        self._tasks: dict[str, tuple[Task, ...]] = {}
        self._engine = AlfredEngine(expert_plan=expert_plan)
        self._loaded_game: str | None = None
        self._task: Task | None = None
        self._instruction = ""
        self._admissible: tuple[str, ...] = ()
        self._admissible_by_norm: dict[str, str] = {}
        self._turn = 0
        self._expert_plan: tuple[str, ...] = ()
        self._done = True
        self._won = False
        self._reset_failed = False
        self._closed = False

    # -- tasks
    def tasks(self, split: str) -> Sequence[Task]:
        if split not in ALFWORLD_SPLITS:
            raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {ALFWORLD_SPLITS}")
        if split not in self._tasks:
            records = discover_games(self.game_root, split)
            if not records:
                raise NoGamesError(f"no solvable ALFWorld games for split {split!r} under "
                                   f"{str(data_dir_of(self.game_root))!r}")
            self._tasks[split] = tuple(r.as_task() for r in records)
        return self._tasks[split]

    def gold_actions(self, task: Task) -> list[str]:
        """Same as ``walkthrough`` (the name ``ScienceWorldEnv`` uses for its gold path)."""
        return self.walkthrough(task)

    def walkthrough(self, task: Task) -> list[str]:
        """The planner's solution of ``task`` from its initial state (stored in the game file when present)."""
        game_file = self._game_file(task)
        stored = read_walkthrough(game_file)
        if stored:
            return stored
        engine = AlfredEngine(expert_plan=True)
        try:
            engine.load(game_file)
            plan = list(engine.reset()["policy_commands"])
        finally:
            engine.close()
        if not plan:
            raise EnvError(f"the planner found no solution for {task.task_id}")
        return plan

    def searching_expert_actions(self, task: Task, *, max_turns: int | None = None, seed: int = 0):
        """The searching expert's episode on ``task`` (``jaxopd_envs.alfworld_expert.play_searching_expert``; its own
        engine, so this environment's episode is untouched). ``max_turns`` None: the expert's default."""
        from jaxopd_envs.alfworld_expert import DEFAULT_EXPERT_MAX_TURNS, play_searching_expert

        return play_searching_expert(self._game_file(task), seed=seed,
                                     max_turns=DEFAULT_EXPERT_MAX_TURNS if max_turns is None else max_turns)

    # -- episode
    def reset(self, task: Task) -> Observation:
        self._check_open()
        game_file = self._game_file(task)
        # The previous episode ends here, whether or not this reset succeeds: a failed load or reset must
        # not leave the old game playable under the new task's name.
        self._task, self._done, self._won, self._reset_failed = None, True, False, True
        if self._loaded_game != game_file:
            self._loaded_game = None
            self._engine.load(game_file)
            self._loaded_game = game_file
        state = self._engine.reset()
        text, self._instruction = split_intro(state["feedback"])
        self._task, self._turn, self._won, self._reset_failed = task, 0, bool(state["won"]), False
        self._done = self._won
        self._set_admissible(state)
        return self._observation(text, state, reward=0.0, valid=True, raw=state["feedback"])

    def step(self, action: str) -> Observation:
        self._check_open()
        if self._task is None:
            if self._reset_failed:
                raise ValueError("step() called after a failed reset(); reset() again first")
            raise ValueError("step() called before reset()")
        if self._done:
            raise ValueError(f"episode of {self._task.task_id} is over; call reset()")
        if not isinstance(action, str):
            raise ValueError(f"action must be a string, got {type(action).__name__}")
        command = self._admissible_by_norm.get(normalize_action(action))
        self._turn += 1
        if command is None:
            obs = Observation(text=REFUSED_FEEDBACK, instruction=self._instruction,
                              admissible_actions=self._admissible, done=False, won=False, score=0.0,
                              reward=0.0, turn=self._turn, last_action_valid=False,
                              info=self._info(raw=REFUSED_FEEDBACK, state=None))
            return self._truncate(obs)
        state, _, _ = self._engine.step(command)
        self._won = bool(state["won"])
        self._done = self._won
        self._set_admissible(state)
        obs = self._observation(state["feedback"].strip(), state, reward=1.0 if self._won else 0.0,
                                valid=True, raw=state["feedback"])
        return self._truncate(obs)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.close()

    # -- helpers
    def _game_file(self, task: Task) -> str:
        if not isinstance(task, Task) or task.benchmark != BENCHMARK:
            raise ValueError(f"not an ALFWorld task: {task!r}")
        game_file = task.payload.get("game_file")
        if not game_file or not os.path.isfile(game_file):
            raise ValueError(f"task {task.task_id} has no readable game file ({game_file!r})")
        return game_file

    def _set_admissible(self, state) -> None:
        self._admissible = admissible_actions(state)
        self._admissible_by_norm = {normalize_action(c): c for c in self._admissible}

    def _observation(self, text: str, state, *, reward: float, valid: bool, raw: str) -> Observation:
        return Observation(text=text, instruction=self._instruction, admissible_actions=self._admissible,
                           done=self._done, won=self._won, score=1.0 if self._won else 0.0, reward=reward,
                           turn=self._turn, last_action_valid=valid, info=self._info(raw=raw, state=state))

    def _info(self, *, raw: str, state) -> dict[str, Any]:
        info: dict[str, Any] = {"game_file": self._loaded_game, "task_type": self._task.task_type, "raw": raw}
        if self._engine.expert_plan:
            if state is not None:       # an invalid action changes nothing: the last plan still holds
                self._expert_plan = tuple(state["policy_commands"])
            info["expert_plan"] = list(self._expert_plan)
        return info

    def _truncate(self, obs: Observation) -> Observation:
        if self.max_turns is None or obs.done or self._turn < self.max_turns:
            return obs
        self._done = True
        return dataclasses.replace(obs, done=True, info={**obs.info, "truncated": True})

    def _check_open(self) -> None:
        if self._closed:
            raise EnvError("AlfWorldEnv is closed")
