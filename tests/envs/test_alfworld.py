"""ALFWorld on the real TextWorld engine: generated games of the six task types, splits, determinism, errors."""
import ast
import collections
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("textworld")

from jaxopd_envs import alfworld as alf  # noqa: E402
from jaxopd_envs import alfworld_engine as engine_module  # noqa: E402
from jaxopd_envs import alfworld_gen as gen  # noqa: E402
from jaxopd_envs.base import EnvError, Task  # noqa: E402
from jaxopd_envs.pool import EnvPool  # noqa: E402

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

REPO = Path(__file__).resolve().parents[2]
SMALL_COUNTS = {"train": 6, "valid_seen": 0, "valid_unseen": 0}   # one game of each task type


@pytest.fixture(scope="session")
def small_games_root(tmp_path_factory):
    """Six generated games (one per task type), cached for the whole session (test_references too)."""
    return gen.ensure_games(tmp_path_factory.getbasetemp() / "alfworld_games", seed=0, counts=SMALL_COUNTS,
                            workers=1, progress=False)


@pytest.fixture(scope="module")
def env(small_games_root):
    with alf.AlfWorldEnv(small_games_root) as environment:
        yield environment


def _traj(task):
    return json.loads((Path(task.payload["game_file"]).parent / "traj_data.json").read_text())


# ------------------------------------------------------------------------------------------- playing


def test_each_task_type_is_won_by_its_walkthrough(env):
    tasks = env.tasks("train")
    assert env.source == "generated"
    assert sorted(t.task_type for t in tasks) == sorted(alf.TASK_TYPES)
    for task in tasks:
        walkthrough = env.walkthrough(task)
        assert 4 <= len(walkthrough) <= 12, walkthrough
        obs = env.reset(task)
        desc = _traj(task)["turk_annotations"]["anns"][0]["task_desc"]
        assert obs.instruction == f"Your task is to: {desc}."
        assert obs.text.startswith("You are in the middle of a room. Looking quickly around you, you see ")
        assert "Welcome to TextWorld" not in obs.text and "Your task is to" not in obs.text
        assert (obs.turn, obs.done, obs.won, obs.score) == (0, False, False, 0.0)
        assert "help" not in obs.admissible_actions and "look" in obs.admissible_actions
        for turn, action in enumerate(walkthrough, start=1):
            assert action in obs.admissible_actions
            obs = env.step(action)
            assert obs.turn == turn and obs.last_action_valid
            last = turn == len(walkthrough)
            assert (obs.won, obs.done, obs.score, obs.reward) == ((True, True, 1.0, 1.0) if last
                                                                   else (False, False, 0.0, 0.0))
        assert obs.info["task_type"] == task.task_type


def test_observation_texts_follow_the_alfworld_grammar(env):
    task = next(t for t in env.tasks("train") if t.task_type == "pick_heat_then_place_in_recep")
    walkthrough = env.walkthrough(task)
    env.reset(task)
    texts = [env.step(a).text for a in walkthrough]
    verbs = [a.split()[0] for a in walkthrough]
    assert verbs[-4:] == ["go", "heat", "go", "move"] or verbs[-5:-1] == ["go", "heat", "go", "open"]
    for action, text in zip(walkthrough, texts):
        words = action.split()
        if words[0] == "go":
            assert text.startswith(f"You arrive at {' '.join(words[2:])}.")
        elif words[0] == "take":
            obj, rec = " ".join(words[1:3]), " ".join(words[4:])
            assert text == f"You pick up the {obj} from the {rec}."
        elif words[0] == "heat":
            assert text == f"You heat the {' '.join(words[1:3])} using the {' '.join(words[4:])}."
        elif words[0] == "move":
            assert text == f"You move the {' '.join(words[1:3])} to the {' '.join(words[4:])}."


def test_invalid_and_normalised_actions(env):
    task = env.tasks("train")[0]
    obs = env.reset(task)
    admissible = obs.admissible_actions
    bad = env.step("help")                      # excluded from the admissible set, so not executed
    assert (bad.text, bad.turn, bad.last_action_valid, bad.done) == ("Nothing happens.", 1, False, False)
    assert bad.admissible_actions == admissible
    assert env.step("fly to the moon").turn == 2
    first = env.walkthrough(task)[0]
    good = env.step("  " + first.upper().replace(" ", "   ") + " \n")
    assert good.last_action_valid and good.turn == 3
    assert good.text.startswith(f"You arrive at {' '.join(first.split()[2:])}.")


def test_step_errors(env):
    fresh = alf.AlfWorldEnv(env.game_root)
    with pytest.raises(ValueError, match="before reset"):
        fresh.step("look")
    fresh.close()
    fresh.close()                                # idempotent
    with pytest.raises(EnvError, match="closed"):
        fresh.reset(env.tasks("train")[0])
    with pytest.raises(ValueError, match="unknown ALFWorld split"):
        env.tasks("eval")
    with pytest.raises(ValueError, match="not an ALFWorld task"):
        env.reset(Task("scienceworld", "train", "sw/boil/0", "boil", {"task_name": "boil", "variation": 0}))
    task = env.tasks("train")[0]
    env.reset(task)
    for action in env.walkthrough(task):
        obs = env.step(action)
    assert obs.done
    with pytest.raises(ValueError, match="is over"):
        env.step("look")


def test_max_turns_truncates(small_games_root):
    with alf.AlfWorldEnv(small_games_root, max_turns=2) as limited:
        limited.reset(limited.tasks("train")[0])
        assert not limited.step("look").done
        obs = limited.step("look")
        assert obs.done and not obs.won and obs.info["truncated"]


def test_expert_plan_info_follows_the_state(small_games_root):
    with alf.AlfWorldEnv(small_games_root, expert_plan=True) as planned:
        task = next(t for t in planned.tasks("train") if t.task_type == "pick_and_place_simple")
        walkthrough = planned.walkthrough(task)
        obs = planned.reset(task)
        plan = obs.info["expert_plan"]
        assert len(plan) == len(walkthrough)          # the planner may break ties differently
        obs = planned.step(plan[0])
        assert len(obs.info["expert_plan"]) == len(plan) - 1
        assert planned.step("help").info["expert_plan"] == obs.info["expert_plan"]
        while not obs.done:                           # following the planner from any state wins
            obs = planned.step(obs.info["expert_plan"][0])
        assert obs.won and obs.turn == len(walkthrough) + 1 and obs.info["expert_plan"] == []


def test_engine_errors_surface_as_env_error(tmp_path):
    game_dir = tmp_path / alf.DATA_SUBDIR / "train" / "pick_and_place_simple-Mug-None-Desk-301" / "trial_x"
    game_dir.mkdir(parents=True)
    (game_dir / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    (game_dir / "game.tw-pddl").write_text(json.dumps(
        {"pddl_domain": gen._alfred()["domain"], "grammar": gen._alfred()["grammar"],
         "pddl_problem": "(define (problem broken) (:domain alfred) (:objects agent1 - agent) (:init",
         "solvable": True, "walkthrough": None}))
    with alf.AlfWorldEnv(tmp_path) as broken:
        assert broken.source == "official"
        with pytest.raises(EnvError, match="cannot load ALFWorld game"):
            broken.reset(broken.tasks("train")[0])


def _broken_game_task(tmp_path) -> Task:
    game_dir = tmp_path / "broken_game"
    game_dir.mkdir()
    (game_dir / alf.GAME_FILE).write_text(json.dumps(
        {"pddl_domain": gen._alfred()["domain"], "grammar": gen._alfred()["grammar"],
         "pddl_problem": "(define (problem broken) (:domain alfred) (:objects agent1 - agent) (:init",
         "solvable": True, "walkthrough": None}))
    return Task("alfworld", "train", "alfworld/train/broken", "pick_and_place_simple",
                {"game_file": str(game_dir / alf.GAME_FILE)})


def test_failed_reset_ends_the_previous_episode(env, tmp_path):
    """Issue 15.17: a reset that fails (corrupt game file) must not leave the previous episode playable."""
    task = next(t for t in env.tasks("train") if t.task_type == "pick_and_place_simple")
    walkthrough = env.walkthrough(task)
    env.reset(task)
    env.step(walkthrough[0])
    with pytest.raises(EnvError, match="cannot load ALFWorld game"):
        env.reset(_broken_game_task(tmp_path))
    with pytest.raises(ValueError, match="failed reset"):
        env.step(walkthrough[1])
    obs = env.reset(task)                          # the environment itself is fine: a new reset plays
    for action in walkthrough:
        obs = env.step(action)
    assert obs.won


# ----------------------------------------------------------------------------------- module layout


def _envs_imports(module_file: Path) -> set[str]:
    """Every ``jaxopd_envs.*`` module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jaxopd_envs":
                names |= {f"jaxopd_envs.{alias.name}" for alias in node.names}
            elif node.module.startswith("jaxopd_envs."):
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("jaxopd_envs.")}
    return names


def test_the_engine_module_breaks_the_import_circle():
    """Issue 9.5: alfworld and alfworld_gen both import alfworld_engine; the generator never imports alfworld."""
    envs_dir = REPO / "envs"
    engine = _envs_imports(envs_dir / "alfworld_engine.py")
    generator = _envs_imports(envs_dir / "alfworld_gen.py")
    environment = _envs_imports(envs_dir / "alfworld.py")
    assert "jaxopd_envs.alfworld" not in engine | generator and "jaxopd_envs.alfworld_gen" not in engine
    assert "jaxopd_envs.alfworld_engine" in generator and "jaxopd_envs.alfworld_engine" in environment
    assert alf.AlfredEngine is engine_module.AlfredEngine and alf.TASK_TYPES is engine_module.TASK_TYPES
    assert gen.AlfredEngine is engine_module.AlfredEngine
    # experiments/ reads TASK_TYPES without the alfworld package: no alfworld, textworld or planner import
    script = ("import sys\n"
              "for name in ('alfworld', 'textworld', 'fast_downward', 'tatsu'): sys.modules[name] = None\n"
              "import jaxopd_envs.alfworld, jaxopd_envs.alfworld_engine\n"
              "print(len(jaxopd_envs.alfworld.TASK_TYPES))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0 and result.stdout.split() == ["6"], result.stderr[-2000:]


# --------------------------------------------------------------------------------------------- games


@pytest.mark.timeout(60)
def test_zero_games_is_a_clear_error_and_does_not_hang(tmp_path):
    (tmp_path / alf.DATA_SUBDIR / "train").mkdir(parents=True)
    with alf.AlfWorldEnv(tmp_path) as empty:
        for split in alf.ALFWORLD_SPLITS:
            with pytest.raises(alf.NoGamesError, match=f"no solvable ALFWorld games for split '{split}'"):
                empty.tasks(split)
    with pytest.raises(alf.NoGamesError, match="does not exist"):
        alf.AlfWorldEnv(tmp_path / "missing")
    with pytest.raises(ValueError, match="zero ALFWorld games"):
        gen.generate_games(tmp_path / "none", counts={"train": 0})


@pytest.mark.timeout(60)
def test_official_tree_discovery_filters_like_alfworld(small_games_root, tmp_path, monkeypatch):
    """A json_2.1.1 tree without our index is read like AlfredTWEnv.collect_game_files does."""
    source = alf.data_dir_of(small_games_root) / "train"
    games = sorted(p.parent for p in source.rglob("game.tw-pddl"))
    train = tmp_path / alf.DATA_SUBDIR / "train"
    kept = games[0]
    shutil.copytree(kept, train / kept.relative_to(source))
    # skipped: movable / Sliced folders, unsolvable games, missing game file, unknown task type
    shutil.copytree(games[1], train / "pick_and_place_with_movable_recep-X-Y-Z-1" / "trial_a")
    shutil.copytree(games[2], train / "pick_heat_then_place_in_recep-AppleSliced-None-Fridge-1" / "trial_b")
    unsolvable = train / "unsolvable" / "trial_c"
    shutil.copytree(games[3], unsolvable)
    data = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**data, "solvable": False}))
    no_game = train / "no_game" / "trial_d"
    shutil.copytree(games[4], no_game)
    (no_game / "game.tw-pddl").unlink()
    other_type = train / "other" / "trial_e"
    shutil.copytree(games[5], other_type)
    traj = json.loads((other_type / "traj_data.json").read_text())
    (other_type / "traj_data.json").write_text(json.dumps({**traj, "task_type": "pick_and_place_with_movable_recep"}))

    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with alf.AlfWorldEnv() as official:        # $ALFWORLD_DATA holds json_2.1.1: no generation happens
        assert official.source == "official" and official.game_root == tmp_path
        tasks = official.tasks("train")
        assert [t.task_id for t in tasks] == [f"alfworld/train/{kept.relative_to(source).as_posix()}"]
        walkthrough = official.walkthrough(tasks[0])
        obs = official.reset(tasks[0])
        for action in walkthrough:
            obs = official.step(action)
        assert obs.won
        with pytest.raises(alf.NoGamesError):
            official.tasks("valid_unseen")


def test_generator_counts_are_ints_not_bools(tmp_path):
    """Issue 15.19: counts={"train": True} is not one game."""
    for counts in ({"train": True}, {"train": 2.0}, {"train": "3"}, {"train": -1}, {"test": 1}):
        with pytest.raises(ValueError, match="games must be|unknown ALFWorld split"):
            gen.generate_games(tmp_path / "none", counts=counts)
        with pytest.raises(ValueError, match="games must be|unknown ALFWorld split"):
            gen.ensure_games(tmp_path / "cache", counts=counts)
    with pytest.raises(ValueError, match="max_walkthrough"):
        gen.generate_games(tmp_path / "none", counts={"train": 1}, max_walkthrough=True)
    with pytest.raises(ValueError, match="max_turns"):
        alf.AlfWorldEnv(tmp_path, max_turns=True)
    assert not (tmp_path / "none").exists() and not (tmp_path / "cache").exists()


def test_floor_plan_from_the_shipped_layouts():
    plan = gen.load_floor_plan(1)
    assert plan.scene_type == "Kitchen"
    sink = plan.receptacles_of("SinkBasin")
    # openable.json: "Sink|-01.90|+00.97|-01.50|SinkBasin": [-1.25, -1.5, 270, 30] → grid (-5, -6), 3 quarter turns
    assert [(r.alfred_id, r.location, r.openable) for r in sink] == [
        ("Sink|-01.90|+00.97|-01.50|SinkBasin", "loc|-5|-6|3|30", False)]
    counts = collections.Counter(r.rtype for r in plan.receptacles)
    assert counts == {"Cabinet": 8, "Drawer": 8, "CounterTop": 3, "Shelf": 2, "Fridge": 1, "Microwave": 1,
                      "SinkBasin": 1, "CoffeeMachine": 1, "GarbageCan": 1, "StoveBurner": 1, "Toaster": 1}
    assert {r.rtype for r in plan.receptacles if r.openable} == {"Cabinet", "Drawer", "Fridge", "Microwave"}
    assert "Apple" in plan.object_types and "Window" not in plan.object_types and "Sink" not in plan.object_types
    assert gen.load_floor_plan(1) is plan
    with pytest.raises(ValueError, match="FloorPlan999"):
        gen.load_floor_plan(999)


def test_expert_uses_shared_poses_and_opens_once():
    """Hand-checked: two co-located drawers (same interaction pose) of FloorPlan1, pick two spatulas."""
    plan = gen.load_floor_plan(1)
    drawer_a = next(r for r in plan.receptacles if r.alfred_id == "Drawer|+00.95|+00.22|-02.20")
    drawer_b = next(r for r in plan.receptacles if r.alfred_id == "Drawer|+00.95|+00.39|-02.20")
    sink = plan.receptacles_of("SinkBasin")[0]
    assert drawer_a.location == drawer_b.location
    s1 = gen.PlacedObject("Spatula|+00.90|+00.22|-02.10", "Spatula", drawer_a)
    s2 = gen.PlacedObject("Spatula|+00.90|+00.39|-02.10", "Spatula", drawer_b)
    params = gen.TaskParams("pick_two_obj_and_place", "Spatula", "SinkBasin")
    steps = gen.expert_steps(plan, params, [s2, s1], "loc|0|0|0|30")
    a, b, k = drawer_a.alfred_id, drawer_b.alfred_id, sink.alfred_id
    assert steps == (("go", a), ("open", a), ("take", s1.alfred_id, a), ("go", k), ("move", s1.alfred_id, k),
                     ("go", b), ("open", b), ("take", s2.alfred_id, b), ("go", k), ("move", s2.alfred_id, k))
    # with both spatulas in drawer a, the second take needs no "open"
    s2_in_a = gen.PlacedObject(s2.alfred_id, "Spatula", drawer_a)
    assert len(gen.expert_steps(plan, params, [s1, s2_in_a], "loc|0|0|0|30")) == 9


def test_expert_matches_the_planner_length(small_games_root):
    """TextWorld's fast-downward planner (optimal, unit costs for moves) finds plans as short as the expert."""
    games = {g["task_type"]: g for g in json.loads((small_games_root / alf.INDEX_FILE).read_text())["games"]}
    engine = alf.AlfredEngine()
    try:
        for task_type in ("pick_and_place_simple", "look_at_obj_in_light"):
            game_file = alf.data_dir_of(small_games_root) / "train" / games[task_type]["relative_dir"] / alf.GAME_FILE
            data = json.loads(game_file.read_text())
            planner = gen.planner_walkthrough(data, engine=engine)
            assert len(planner) == len(data["walkthrough"]) == games[task_type]["walkthrough_steps"]
            assert planner[0].startswith("go to ")
    finally:
        engine.close()


def test_sampled_games_are_distinct_split_disjoint_and_seed_determined():
    """>= 300 game slots sampled (no engine): distinct initial states, unseen rooms held out."""
    counts = {"train": 240, "valid_seen": 30, "valid_unseen": 36}
    sampler, other_seed = gen._Sampler(0), gen._Sampler(1)
    specs = [sampler.sample(split, i, 0)[0] for split, n in counts.items() for i in range(n)]
    assert len({s.state_key for s in specs}) == len(specs) == 306
    plans = {split: {s.floor_plan for s in specs if s.split == split} for split in counts}
    assert plans["valid_unseen"] <= set(gen.split_floor_plans("valid_unseen"))
    assert plans["valid_unseen"].isdisjoint(plans["train"] | plans["valid_seen"])
    for split in counts:
        assert {s.params.task_type for s in specs if s.split == split} == set(alf.TASK_TYPES)
    again = [gen._Sampler(0).sample("train", i, 0)[0] for i in range(5)]
    assert [s.pddl_problem for s in again] == [s.pddl_problem for s in specs[:5]]
    different = [other_seed.sample("train", i, 0)[0] for i in range(5)]
    assert all(a.state_key != b.state_key for a, b in zip(specs[:5], different))


def test_same_seed_gives_byte_identical_games(small_games_root, tmp_path):
    """The CLI in a fresh interpreter (other hash seed, two worker processes) writes the same bytes for the
    first two train games (a game slot does not depend on how many games follow it)."""
    out = tmp_path / "again"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "jaxopd_envs.alfworld_gen", "--out", str(out), "--num", "2",
                             "--num-valid-seen", "0", "--num-valid-unseen", "0", "--seed", "0", "--workers", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 games in" in result.stdout
    index = json.loads((out / alf.INDEX_FILE).read_text())
    reference_index = json.loads((small_games_root / alf.INDEX_FILE).read_text())
    assert index["games"] == reference_index["games"][:2]
    files = sorted(p.relative_to(out) for p in (out / alf.DATA_SUBDIR).rglob("*") if p.is_file())
    assert len(files) == 3 * 2
    for rel in files:
        assert (small_games_root / rel).read_bytes() == (out / rel).read_bytes(), rel


def test_unseen_games_do_not_depend_on_the_train_count(tmp_path):
    """More generated training games (``experiments.train --generated-train-games``) leave the valid_unseen games
    byte for byte the same: their floor plans are held out from train's, and every slot is seeded on its own."""
    trees = {}
    for train in (0, 2):
        root = tmp_path / f"train{train}"
        gen.generate_games(root, seed=0, counts={"train": train, "valid_seen": 0, "valid_unseen": 1}, workers=1,
                           progress=False)
        unseen = root / alf.DATA_SUBDIR / "valid_unseen"
        trees[train] = {p.relative_to(unseen): p.read_bytes() for p in unseen.rglob("*") if p.is_file()}
    assert len(trees[0]) == 3 and trees[0] == trees[2]


def test_cli_counts_training_makes_the_tree_of_generated_train_games(monkeypatch, capsys):
    """``python -m jaxopd_envs.alfworld_gen --counts training --num N`` asks for the very tree (same counts, same cache
    folder) that ``experiments.train --generated-train-games N`` uses; without --counts it keeps the environment's
    own split sizes (those of the main job's games)."""
    from jaxopd_experiments.train import training_counts
    from jaxopd.methods.benchmarks import GeneratedCounts
    from jaxopd.methods.config import SFTConfig

    asked = []

    def fake_ensure(cache_dir=None, *, seed, counts, workers, max_walkthrough):
        asked.append(dict(counts))
        return Path("/nowhere") / gen.version_hash(seed=seed, counts=counts, max_walkthrough=max_walkthrough)

    monkeypatch.setattr(gen, "ensure_games", fake_ensure)
    assert gen.main(["--counts", "training", "--num", "720"]) == 0
    assert gen.main([]) == 0
    assert gen.main(["--counts", "training", "--num-valid-unseen", "5"]) == 0
    trained = training_counts(SFTConfig(generated_train_games=720)).as_counts()
    assert asked[0] == trained == {"train": 720, "valid_seen": 24, "valid_unseen": 48}
    assert asked[1] == gen.DEFAULT_COUNTS == {"train": 600, "valid_seen": 140, "valid_unseen": 134}
    assert asked[2] == {"train": 240, "valid_seen": 24, "valid_unseen": 5}
    assert GeneratedCounts().as_counts() == gen.TRAINING_COUNTS
    printed = capsys.readouterr().out.splitlines()
    assert gen.version_hash(seed=0, counts=trained, max_walkthrough=gen.DEFAULT_MAX_WALKTHROUGH) in printed[0]
    assert "720 train, 24 valid_seen, 48 valid_unseen" in printed[0]


def test_cache_location_and_reuse(small_games_root, tmp_path, monkeypatch):
    monkeypatch.setenv(gen.CACHE_ENV_VAR, str(tmp_path))
    assert gen.cache_base() == tmp_path / "alfworld_games"
    assert gen.cache_base(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv(gen.CACHE_ENV_VAR)
    assert gen.cache_base() == Path.home() / ".cache" / "jaxopd" / "alfworld_games"
    # a second ensure_games with the same configuration returns the cached tree without generating
    def refuse(*args, **kwargs):
        raise AssertionError("ensure_games generated games for a configuration already in the cache")
    monkeypatch.setattr(gen, "generate_games", refuse)
    assert gen.ensure_games(small_games_root.parent, seed=0, counts=SMALL_COUNTS, progress=False) == small_games_root
    assert small_games_root.name == gen.version_hash(seed=0, counts=SMALL_COUNTS,
                                                     max_walkthrough=gen.DEFAULT_MAX_WALKTHROUGH)
    assert gen.version_hash(seed=1, counts=SMALL_COUNTS, max_walkthrough=30) != small_games_root.name


def test_engines_in_threads_match_sequential_play(small_games_root):
    """TextWorld parsers and PDDL translation are process-global state; engines in threads stay independent."""
    with alf.AlfWorldEnv(small_games_root) as probe:
        tasks = [t for t in probe.tasks("train") if t.task_type in ("pick_two_obj_and_place",
                                                                     "pick_and_place_simple")]
        plans = {t.task_id: probe.walkthrough(t) for t in tasks}

    def play(task, out):
        with alf.AlfWorldEnv(small_games_root) as environment:
            obs = environment.reset(task)
            texts = [obs.text]
            for action in plans[task.task_id]:
                obs = environment.step(action)
                texts.append(obs.text)
            out[task.task_id] = (texts, obs.won)

    sequential, threaded = {}, {}
    for task in tasks:
        play(task, sequential)
    argv = list(sys.argv)
    engine_module._translations.clear()    # make both threads translate at the same time
    threads = [threading.Thread(target=play, args=(t, threaded)) for t in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert threaded == sequential and all(won for _, won in threaded.values())
    assert sys.argv == argv


# ---------------------------------------------------------------------- worker processes (issue 14)


POOL_TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_and_place_simple")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool_episodes(env):
    """Per slot: (task, actions, observations of one thread playing them). The actions are the walkthrough
    with two bad actions after its first step ("help" is excluded, the other is not a command)."""
    episodes = []
    for task_type in POOL_TASK_TYPES:
        task = next(t for t in env.tasks("train") if t.task_type == task_type)
        walkthrough = env.walkthrough(task)
        actions = [walkthrough[0], "help", "fly to the moon", *walkthrough[1:]]
        observations = [env.reset(task)] + [env.step(a) for a in actions]
        episodes.append((task, actions, observations))
    return episodes


def _play(pool: EnvPool, episodes, start: int, stop: int | None = None) -> None:
    """Step every slot through actions[start:stop], the slots' calls submitted together each round."""
    rounds = max(len(actions) for _, actions, _ in episodes)
    for turn in range(start, rounds if stop is None else stop):
        futures = [pool.submit_step(slot, actions[turn]) for slot, (_, actions, _) in enumerate(episodes)
                   if turn < len(actions)]
        for future in futures:
            future.result()


def test_two_worker_processes_give_the_observations_of_one_thread(small_games_root, pool_episodes):
    """Three slots on two worker processes play what one thread plays; bad actions behave as in a thread;
    close() leaves no worker process, thread or temporary folder."""
    threads_before = set(threading.enumerate())
    temp_before = set(os.listdir(tempfile.gettempdir()))
    factory = functools.partial(alf.AlfWorldEnv, small_games_root)
    with EnvPool(factory, len(pool_episodes), max_workers=2) as pool:
        assert pool.backend == "process" and len(set(pool.worker_of(s) for s in range(3))) == 2
        for future in [pool.submit_reset(slot, task) for slot, (task, _, _) in enumerate(pool_episodes)]:
            future.result()
        _play(pool, pool_episodes, 0)
        for slot, (_, actions, observations) in enumerate(pool_episodes):
            trajectory = pool.trajectory(slot)
            assert trajectory.actions == tuple(actions)
            assert list(trajectory.observations) == observations        # every compared field, not only text
            bad = trajectory.observations[2:4]
            assert [(o.text, o.turn, o.last_action_valid) for o in bad] == [("Nothing happens.", 2, False),
                                                                           ("Nothing happens.", 3, False)]
            assert bad[0].admissible_actions == trajectory.observations[1].admissible_actions
            assert trajectory.observations[-1].won and trajectory.recoveries == 0
        with pytest.raises(ValueError, match="is over"):          # as in a thread: bad input, env kept
            pool.step(0, "look")
        assert pool.recoveries == 0
        pids = list(pool.worker_pids)
        assert len(pids) == 2 and all(_pid_alive(pid) for pid in pids)
    assert not any(_pid_alive(pid) for pid in pids)
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(threading.enumerate()) <= threads_before
    assert set(os.listdir(tempfile.gettempdir())) - temp_before == set()


def test_killed_alfworld_worker_is_replayed(small_games_root, pool_episodes):
    factory = functools.partial(alf.AlfWorldEnv, small_games_root)
    with EnvPool(factory, len(pool_episodes), max_workers=2) as pool:
        for slot, (task, _, _) in enumerate(pool_episodes):
            pool.reset(slot, task)
        _play(pool, pool_episodes, 0, 3)
        victim = pool.worker_pids[pool.worker_of(0)]                # holds slots 0 and 2
        os.kill(victim, signal.SIGKILL)
        _play(pool, pool_episodes, 3)
        for slot, (_, actions, observations) in enumerate(pool_episodes):
            trajectory = pool.trajectory(slot)
            assert trajectory.actions == tuple(actions) and list(trajectory.observations) == observations
        assert [pool.trajectory(s).recoveries for s in range(3)] == [1, 0, 1]
        assert victim not in pool.worker_pids and not _pid_alive(victim)


@pytest.mark.slow
def test_hundreds_of_distinct_solvable_games(tmp_path):
    """>= 300 games generated and verified on the engine; run with -m slow (about 10 min on 2 busy cores)."""
    counts = {"train": 240, "valid_seen": 30, "valid_unseen": 36}
    start = time.perf_counter()
    games = gen.generate_games(tmp_path / "games", seed=0, counts=counts, workers=2, progress=False)
    elapsed = time.perf_counter() - start
    print(f"\n{len(games)} games in {elapsed:.0f} s ({elapsed / len(games):.2f} s/game, 2 workers)")
    index = json.loads((tmp_path / "games" / alf.INDEX_FILE).read_text())
    assert len({g["state_key"] for g in index["games"]}) == len(index["games"]) == 306
    by_split = collections.defaultdict(list)
    for g in index["games"]:
        by_split[g["split"]].append(g)
    assert {k: len(v) for k, v in by_split.items()} == counts
    unseen_plans = {g["floor_plan"] for g in by_split["valid_unseen"]}
    seen_plans = {g["floor_plan"] for s in ("train", "valid_seen") for g in by_split[s]}
    assert unseen_plans.isdisjoint(seen_plans)
    with alf.AlfWorldEnv(tmp_path / "games") as environment:
        for split in counts:
            tasks = environment.tasks(split)
            assert len(tasks) == counts[split]
            assert {t.task_type for t in tasks} == set(alf.TASK_TYPES)
            for task in tasks:
                data = json.loads(Path(task.payload["game_file"]).read_text())
                assert data["solvable"] is True and 1 <= len(data["walkthrough"]) <= gen.DEFAULT_MAX_WALKTHROUGH
        for task_type in alf.TASK_TYPES:              # replay one unseen game of each type through the env
            task = next(t for t in environment.tasks("valid_unseen") if t.task_type == task_type)
            environment.reset(task)
            for action in environment.walkthrough(task):
                obs = environment.step(action)
            assert obs.won
