"""Reference trajectories: built from walkthroughs / gold paths, validated by replay, cached as JSON."""
import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxopd_envs import references as refs
from jaxopd_envs.base import Observation, Task, TextEnv
from jaxopd_envs.checks import check_transition

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

SMALL_COUNTS = {"train": 6, "valid_seen": 0, "valid_unseen": 0}   # same tree as tests/envs/test_alfworld.py


# ------------------------------------------------------------------------------------- a toy environment


class ToyEnv(TextEnv):
    """Success needs "focus on x", "take x" and "put x" in this order; "look around" and "wait" are
    no-ops; "open door" is invalid (already open). Counts resets to show what was replayed."""

    benchmark = "toy"
    needed = ("focus on x", "take x", "put x")

    def __init__(self, solution):
        self.solution, self.resets = list(solution), 0

    def tasks(self, split):
        return [Task("toy", split, "toy/0", "toy")]

    def walkthrough(self, task):
        return list(self.solution)

    def reset(self, task):
        self.resets, self.progress, self.turn = self.resets + 1, 0, 0
        return self._obs("start", True)

    def step(self, action):
        self.turn += 1
        if self.progress < 3 and action == self.needed[self.progress]:
            self.progress += 1
        return self._obs(f"after {action}", action != "open door")

    def _obs(self, text, valid):
        won = self.progress == 3
        return Observation(text=text, instruction="do it", admissible_actions=("look around", "take x"),
                           done=won, won=won, score=100.0 if won else 0.0, turn=self.turn,
                           last_action_valid=valid)


def test_shortening_drops_noops_and_invalid_steps_but_never_focus():
    solution = ["look around", "open door", "focus on x", "wait", "take x", "look around", "put x", "wait"]
    env = ToyEnv(solution)
    task = env.tasks("train")[0]
    best = refs.shorten_actions(env, task, solution)
    assert best.succeeded and best.actions == ("focus on x", "take x", "put x")
    assert env.resets == 2                      # full replay, then every candidate dropped at once
    assert [o.text for o in best.observations] == ["start", "after focus on x", "after take x", "after put x"]


def test_shortening_is_greedy_when_dropping_all_fails():
    # "look around" is needed here, so dropping everything fails and candidates are tried last first
    class NeedsLook(ToyEnv):
        needed = ("look around", "take x", "put x")

    solution = ["open door", "look around", "wait", "take x", "put x"]
    env = NeedsLook(solution)
    task = env.tasks("train")[0]
    assert refs.shorten_actions(env, task, solution).actions == ("look around", "take x", "put x")
    assert env.resets == 1 + 1 + 3              # full, all-at-once, then "open door", "look around", "wait"
    limited = NeedsLook(solution)
    assert refs.shorten_actions(limited, task, solution, max_trials=2).actions == (
        "look around", "wait", "take x", "put x")           # the budget allowed one greedy trial
    with pytest.raises(refs.ReferenceBuildError, match="do not reach success"):
        refs.shorten_actions(NeedsLook([]), task, ["take x"])


def test_reference_trajectory_api_and_json():
    records = tuple(refs.ReferenceObservation(text=t, done=d, won=d, score=float(d), admissible_actions=("a",))
                    for t, d in (("o1", False), ("o2", False), ("o3", True)))
    ref = refs.ReferenceTrajectory("toy/0", ("a1", "a2"), ("o1", "o2", "o3"), benchmark="toy", records=records)
    assert len(ref) == 2
    assert [ref.next_observation(t) for t in (1, 2, 3)] == ["o2", "o3", None]
    assert ref.next_record(2).done and ref.action(1) == "a1" and ref.action(3) is None
    with pytest.raises(ValueError, match="turn must be"):
        ref.next_observation(0)
    assert refs.ReferenceTrajectory.from_json(json.loads(json.dumps(ref.to_json()))) == ref
    with pytest.raises(ValueError, match="need 3 observations"):
        refs.ReferenceTrajectory("toy/0", ("a1", "a2"), ("o1", "o2"))
    with pytest.raises(ValueError, match="format"):
        refs.ReferenceTrajectory.from_json({**ref.to_json(), "format": 0})
    with pytest.raises(ValueError, match="does not exist"):
        refs.load_references("/nonexistent/references")


def test_reference_flags_and_turns_are_typed(tmp_path):
    """Issue 15.19: "done": "False" in a cache file is not a finished episode; turn True is not turn 1."""
    records = (refs.ReferenceObservation(text="o1"), refs.ReferenceObservation(text="o2", done=True, won=True))
    ref = refs.ReferenceTrajectory("toy/0", ("a1",), ("o1", "o2"), benchmark="toy", records=records)
    data = ref.to_json()
    for field, value in (("done", "False"), ("done", 0), ("won", "true"), ("done", None), ("score", "1")):
        broken = {**data, "records": [{**data["records"][0], field: value}, data["records"][1]]}
        with pytest.raises(ValueError, match=field):
            refs.ReferenceTrajectory.from_json(broken)
        path = tmp_path / f"{field}-{value}.ref.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="unreadable reference file"):
            refs.load_reference(path)
    with pytest.raises(ValueError, match="admissible_actions"):
        refs.ReferenceObservation(text="o", admissible_actions="look around")     # not letter by letter
    assert refs.ReferenceObservation(text="o", done=np.bool_(True)).done is True
    assert ref.next_observation(np.int64(1)) == "o2" and ref.action(np.int32(1)) == "a1"
    for turn in (True, 1.0, "1"):
        with pytest.raises(ValueError, match="turn must be an int"):
            ref.next_observation(turn)


def test_build_references_argument_errors(tmp_path):
    env_factory = functools.partial(ToyEnv, ["focus on x", "take x", "put x"])
    task = Task("toy", "train", "toy/0", "toy")
    with pytest.raises(ValueError, match="no tasks"):
        refs.build_references(env_factory, [], tmp_path)
    with pytest.raises(ValueError, match="duplicate task ids"):
        refs.build_references(env_factory, [task, task], tmp_path)
    with pytest.raises(ValueError, match="picklable"):
        refs.build_references(lambda: ToyEnv([]), [task, Task("toy", "train", "toy/1", "toy")], tmp_path,
                              workers=2)
    built = refs.build_references(env_factory, [task], tmp_path)
    assert built["toy/0"].actions == ("focus on x", "take x", "put x") and built["toy/0"].source == "walkthrough"



class ManyToys(ToyEnv):
    """ToyEnv with several tasks; "toy/bad"'s walkthrough never wins. Counts the environments made and closed."""

    made, closed = [], []

    def __init__(self):
        super().__init__(["look around", "focus on x", "take x", "put x"])
        ManyToys.made.append(self)

    def walkthrough(self, task):
        return ["take x"] if task.task_id == "toy/bad" else list(self.solution)

    def close(self):
        ManyToys.closed.append(self)


def test_lazy_references_build_on_first_use_once_and_equal_the_eager_ones(tmp_path):
    ManyToys.made, ManyToys.closed = [], []
    tasks = [Task("toy", "train", f"toy/{name}", "toy") for name in ("a", "b", "c", "bad")]
    lazy = refs.LazyReferences(ManyToys, tasks, tmp_path / "cache")
    assert len(lazy) == 4 and list(lazy) == ["toy/a", "toy/b", "toy/c", "toy/bad"] and "toy/b" in lazy
    assert ManyToys.made == []                              # nothing is built before it is asked for
    a = lazy["toy/a"]
    assert a.actions == ("look around", "focus on x", "take x", "put x") and a.source == "walkthrough"
    assert lazy["toy/a"] is a and (lazy.built, lazy.read) == (1, 0)
    assert len(ManyToys.made) == 1 and ManyToys.made[0].resets == 1      # one replay of one walkthrough
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "cache").iterdir()) == ["toy__a"]
    with pytest.raises(KeyError):
        lazy["toy/z"]                                       # not one of the run's tasks
    assert lazy.get("toy/z") is None

    # several threads asking for the same task build it once
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: lazy["toy/b"], range(8)))
    assert all(g is got[0] for g in got) and (lazy.built, lazy.read) == (2, 0)
    assert len(ManyToys.made) == 1                          # builds share one environment

    # a task whose reference fails names it, and the recorded failure is not replayed again
    with pytest.raises(refs.ReferenceBuildError, match="no reference for toy/bad: .*did not reach success"):
        lazy["toy/bad"]
    resets = ManyToys.made[0].resets
    with pytest.raises(refs.ReferenceBuildError, match="toy/bad"):
        lazy.get("toy/bad")                                 # Mapping.get passes on everything but KeyError
    assert ManyToys.made[0].resets == resets
    lazy.close()
    assert ManyToys.closed == ManyToys.made

    # the same cache as build_references: a new mapping reads what was built, and equals the eager build
    again = refs.LazyReferences(ManyToys, tasks, tmp_path / "cache")
    assert again["toy/a"] == a and (again.built, again.read) == (0, 1) and len(ManyToys.made) == 1
    eager = refs.build_references(ManyToys, tasks[:3], tmp_path / "eager")
    assert {t.task_id: again[t.task_id] for t in tasks[:3]} == eager


def test_lazy_references_start_a_fresh_environment_after_an_engine_error(tmp_path):
    from jaxopd_envs.base import EnvError

    class Flaky(ManyToys):
        def reset(self, task):
            if len(ManyToys.made) == 1:
                raise EnvError("the engine died")
            return super().reset(task)

    ManyToys.made, ManyToys.closed = [], []
    lazy = refs.LazyReferences(Flaky, [Task("toy", "train", "toy/a", "toy")], tmp_path)
    with pytest.raises(refs.ReferenceBuildError, match="no reference for toy/a: EnvError: the engine died"):
        lazy["toy/a"]
    assert ManyToys.closed == ManyToys.made                 # the broken environment was closed
    assert not list(tmp_path.glob("*.failed.json"))         # an engine error is not recorded as the task's failure
    assert lazy["toy/a"].actions[-1] == "put x" and len(ManyToys.made) == 2


# --------------------------------------------------------------------------------------------- ALFWorld


@pytest.fixture(scope="session")
def small_games_root(tmp_path_factory):
    pytest.importorskip("alfworld")
    from jaxopd_envs import alfworld_gen

    return alfworld_gen.ensure_games(tmp_path_factory.getbasetemp() / "alfworld_games", seed=0,
                                     counts=SMALL_COUNTS, workers=1, progress=False)


@pytest.fixture(scope="module")
def alfworld_references(small_games_root, tmp_path_factory):
    from jaxopd_envs.alfworld import AlfWorldEnv

    cache = tmp_path_factory.mktemp("alfworld_refs")
    with AlfWorldEnv(small_games_root) as env:
        tasks = env.tasks("train")
    built = refs.build_references(functools.partial(AlfWorldEnv, small_games_root), tasks, cache)
    return tasks, built, cache


def test_alfworld_references_cover_the_six_types_and_replay(alfworld_references, small_games_root):
    from jaxopd_envs.alfworld import TASK_TYPES, AlfWorldEnv

    tasks, built, cache = alfworld_references
    assert set(built) == {t.task_id for t in tasks}
    assert sorted(r.task_type for r in built.values()) == sorted(TASK_TYPES)
    assert refs.load_references(cache) == built
    assert refs.load_references(cache, benchmark="scienceworld") == {}
    with AlfWorldEnv(small_games_root) as env:
        for task in tasks:
            ref = built[task.task_id]
            walkthrough = env.walkthrough(task)
            assert ref.source == "walkthrough" and ref.actions == tuple(walkthrough)
            assert ref.original_length == len(walkthrough) and ref.benchmark == "alfworld"
            obs = env.reset(task)
            assert (ref.observations[0], ref.instruction) == (obs.text, obs.instruction)
            assert ref.next_observation(1).startswith(f"You arrive at {walkthrough[0][len('go to '):]}.")
            assert ref.next_observation(len(ref) + 1) is None
            assert [r.won for r in ref.records] == [False] * len(ref) + [True]
            assert all(r.admissible_actions and "help" not in r.admissible_actions for r in ref.records)
            for t, action in enumerate(ref.actions, start=1):     # App. B.5 checks pass along the reference
                previous = obs
                obs = env.step(action)
                check = check_transition("alfworld", action, previous.admissible_actions, obs, ref.next_record(t))
                assert check.ok, (task.task_id, t, check.reasons)
            assert obs.won


def test_alfworld_reference_cache_is_reused_and_invalidated(alfworld_references, small_games_root, tmp_path):
    from jaxopd_envs.alfworld import AlfWorldEnv

    tasks, built, cache = alfworld_references
    factory_calls = []

    def counting_factory():
        factory_calls.append(1)
        return AlfWorldEnv(small_games_root)

    assert refs.build_references(counting_factory, tasks, cache) == built
    assert factory_calls == []                  # everything came from the cache, nothing replayed

    # a copy of one game whose file bytes change (same content, other JSON layout) is rebuilt
    copy_root = tmp_path / "games"
    shutil.copytree(small_games_root, copy_root)
    with AlfWorldEnv(copy_root) as env:
        task = env.tasks("train")[0]
    copied_cache = tmp_path / "refs"
    shutil.copytree(cache, copied_cache)
    # moving the tree keeps the fingerprints: the cache is still valid
    assert refs.build_references(counting_factory, [task], copied_cache)[task.task_id] == built[task.task_id]
    assert factory_calls == []
    game_file = Path(task.payload["game_file"])
    stale = refs.task_fingerprint(task, shorten=False)
    game_file.write_text(json.dumps(json.loads(game_file.read_text()), indent=1))
    assert refs.task_fingerprint(task, shorten=False) != stale
    rebuilt = refs.build_references(functools.partial(AlfWorldEnv, copy_root), [task], copied_cache)
    assert rebuilt[task.task_id].actions == built[task.task_id].actions

    # a game whose stored walkthrough does not win fails with a message naming it
    data = json.loads(game_file.read_text())
    game_file.write_text(json.dumps({**data, "walkthrough": ["look", "inventory"]}))
    with pytest.raises(refs.ReferenceBuildError, match="1 of 1 references failed: .*did not reach success"):
        refs.build_references(functools.partial(AlfWorldEnv, copy_root), [task], copied_cache)


# ------------------------------------------------------------------------------- the searching expert


def test_searching_expert_searches_from_what_it_sees_and_wins(small_games_root, monkeypatch):
    """ALFWorld's hand-coded expert, with the engine of alfworld 0.4: it wins all six task types within 30 turns
    (the two-object task only with the ``move`` bookkeeping fix), the same seed gives the same episode, and it
    opens by visiting receptacles named in the room's description (it does not know where the object lies)."""
    from jaxopd_envs.alfworld import AlfWorldEnv
    from jaxopd_envs.alfworld_expert import play_searching_expert

    with AlfWorldEnv(small_games_root) as env:
        for task in env.tasks("train"):
            episode = env.searching_expert_actions(task)
            assert episode.won and episode.reason == "", (task.task_type, episode)
            assert play_searching_expert(task.payload["game_file"]) == episode
            first = env.reset(task)
            targets = [a[len("go to "):] for a in episode.actions if a.startswith("go to ")]
            assert targets and all(f"{t}," in first.text or f"{t}." in first.text for t in targets)
            replayed = refs.replay(env, task, episode.actions)
            assert replayed.succeeded and len(replayed.actions) == len(episode.actions)
            if task.task_type == "pick_two_obj_and_place":
                assert len(episode.actions) > len(env.walkthrough(task))     # it searched
                short = env.searching_expert_actions(task, max_turns=20)
                assert not short.won and short.reason == "not won within 20 turns" and len(short.actions) == 20
    with pytest.raises(ValueError, match="max_turns"):
        play_searching_expert(task.payload["game_file"], max_turns=0)
    # a fault inside the shipped expert's code loses that episode, with its reason, and raises nothing
    from jaxopd_envs.alfworld_import import import_alfworld
    import_alfworld()
    from alfworld.agents.expert import handcoded_expert

    def broken(self, game_state, last_action):
        raise IndexError("Cannot choose from an empty sequence")
    monkeypatch.setattr(handcoded_expert.BasePolicy, "act", broken)
    failed = play_searching_expert(task.payload["game_file"])
    assert not failed.won and failed.actions == ()
    assert failed.reason == "the expert failed: IndexError: Cannot choose from an empty sequence"
    with pytest.raises(ValueError, match="does not exist"):
        play_searching_expert(small_games_root / "nope.tw-pddl")


def test_searching_expert_references_leave_out_unwon_games_and_cache_why(small_games_root, tmp_path, monkeypatch):
    from jaxopd_envs import alfworld_expert
    from jaxopd_envs.alfworld import AlfWorldEnv

    with AlfWorldEnv(small_games_root) as env:
        tasks = env.tasks("train")
    factory = functools.partial(AlfWorldEnv, small_games_root)
    with pytest.raises(refs.ReferenceBuildError, match="1 of 6 references failed: .*pick_two.*searching expert did "
                                                      "not win \\(not won within 20 turns\\)"):
        refs.build_references(factory, tasks, tmp_path, kind="searching_expert", expert_max_turns=20)
    failures = {}
    built = refs.build_references(factory, tasks, tmp_path, kind="searching_expert", expert_max_turns=20,
                                  allow_failures=True, failures=failures)
    (two,) = [t for t in tasks if t.task_type == "pick_two_obj_and_place"]
    assert list(failures) == [two.task_id] and "not won within 20 turns" in failures[two.task_id]
    assert set(built) == {t.task_id for t in tasks} - {two.task_id}
    with AlfWorldEnv(small_games_root) as env:
        for task in tasks:
            if task.task_id in built:
                ref = built[task.task_id]
                assert ref.source == "searching_expert" and ref.records[-1].won
                assert ref.actions == env.searching_expert_actions(task, max_turns=20).actions
                assert refs.replay(env, task, ref.actions).invalid_turns == ()
    # everything, the failure included, now comes from the cache: the expert is not played again
    monkeypatch.setattr(alfworld_expert, "play_searching_expert",
                        lambda *a, **k: pytest.fail("the expert was played again"))
    again = {}
    assert refs.build_references(factory, tasks, tmp_path, kind="searching_expert", expert_max_turns=20,
                                 allow_failures=True, failures=again) == built
    assert again == failures
    # another turn limit or kind is another fingerprint: solution references are unchanged by the kind option
    assert (refs.task_fingerprint(two, shorten=False, kind="searching_expert", expert_max_turns=20)
            != refs.task_fingerprint(two, shorten=False, kind="searching_expert", expert_max_turns=30))
    assert refs.task_fingerprint(two, shorten=False) == refs.task_fingerprint(two, shorten=False, kind="solution")
    with pytest.raises(ValueError, match="unknown reference kind 'oracle'"):
        refs.build_references(factory, tasks, tmp_path, kind="oracle")


def test_searching_expert_report(small_games_root, tmp_path, capsys):
    from jaxopd_envs import alfworld_expert_report

    out = tmp_path / "expert.json"
    assert alfworld_expert_report.main(["--games-root", str(small_games_root), "--split", "train", "--max-turns", "20",
                                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["task_type"]: row for row in result["rows"]}
    assert rows["all"]["games"] == 6 and rows["all"]["won"] == 5           # the two-object game needs 28 turns
    assert rows["pick_two_obj_and_place"]["won"] == 0 and rows["pick_two_obj_and_place"]["mean_turns_won"] is None
    assert [g["reason"] for g in result["games"] if not g["won"]] == ["not won within 20 turns"]
    assert "| all | 6 | 5 | 83.3 % |" in capsys.readouterr().out and out.with_suffix(".md").is_file()


def test_an_expert_action_the_engine_refuses_is_left_out_of_the_reference():
    """The shipped expert sometimes goes to a receptacle it cannot reach ("Nothing happens"); the demonstration
    leaves such a no-op out, and what is left must still win."""

    class ExpertToy(ToyEnv):
        def searching_expert_actions(self, task, *, max_turns=None):
            from jaxopd_envs.alfworld_expert import ExpertEpisode
            return ExpertEpisode(("focus on x", "open door", "take x", "put x"), True)

    ref = refs.build_reference(ExpertToy(["unused"]), Task("toy", "train", "t", "toy"), kind="searching_expert")
    assert ref.actions == ("focus on x", "take x", "put x") and ref.source == "searching_expert"
    with pytest.raises(ValueError, match="has no searching expert"):
        refs.build_reference(ToyEnv(["focus on x"]), Task("toy", "train", "t", "toy"), kind="searching_expert")


# ------------------------------------------------------------------------------------------ ScienceWorld


@pytest.fixture(scope="module")
def scienceworld_references(tmp_path_factory):
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs java")
    pytest.importorskip("scienceworld")
    from jaxopd_envs.scienceworld import ScienceWorldEnv, scienceworld_task

    tasks = [scienceworld_task("boil", 0), scienceworld_task("find-living-thing", 0)]
    cache = tmp_path_factory.mktemp("scienceworld_refs")
    built = refs.build_references(ScienceWorldEnv, tasks, cache, max_trials=6)
    return tasks, built, cache


def test_scienceworld_references_are_shortened_and_replay_to_success(scienceworld_references):
    from jaxopd_envs.scienceworld import ScienceWorldEnv

    tasks, built, cache = scienceworld_references
    assert refs.load_references(cache, benchmark="scienceworld") == built
    boil, living = built["scienceworld/train/boil-0"], built["scienceworld/train/find-living-thing-0"]
    assert boil.source == living.source == "gold_path"
    # gold path 39 steps (notes); success comes at step 36, and the no-ops "open door to kitchen" (the easy
    # preset opens doors) and "look around" go: 32 steps with scienceworld 1.2.3
    assert boil.original_length == 39 and len(boil) <= 32
    assert not any(a.startswith(("open door", "look around")) for a in boil.actions)
    assert boil.actions.count("focus on substance in metal pot") == 1
    assert "boil" in boil.instruction
    # find-living-thing-0: the easy preset opens doors, so the gold path's "open door ..." steps are invalid
    # no-ops, and "look around" is not needed: what remains moves, focuses, picks up and delivers.
    assert living.original_length == 10
    assert not any(a.startswith(("open door", "look around")) for a in living.actions)
    assert [a for a in living.actions if a.startswith("focus on")] == ["focus on butterfly"]
    with ScienceWorldEnv() as env:
        for task in tasks:
            ref = built[task.task_id]
            assert ref.records[-1].score == 100.0 and ref.records[-1].won
            assert not any(r.admissible_actions for r in ref.records)      # not stored for ScienceWorld
            assert all(r.action_templates for r in ref.records)
            obs = env.reset(task)
            for t, action in enumerate(ref.actions, start=1):
                previous, obs = obs, env.step(action)
                check = check_transition("scienceworld", action, previous.admissible_actions, obs, ref.next_record(t))
                # the gold path may name objects by aliases missing from the valid-action list; everything
                # else App. B.5 compares (observation, templates, termination) must agree with the cache
                assert [r for r in check.reasons if "admissible-action list" not in r] == [], (task.task_id, t)
            assert obs.won and obs.score == 100.0


def test_reference_records_are_observation_like():
    record = refs.ReferenceObservation(text="x", done=True, action_templates=("look around",))
    assert dataclasses.asdict(record)["action_templates"] == ("look around",)
    assert check_transition("scienceworld", "look around", ["look around"], record, record).ok
