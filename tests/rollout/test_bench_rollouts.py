"""The rollout benchmarks' own logic (bench/env_throughput.py, bench/rollout_quality.py) without running them:
options, the scaled thinking budget, transition timestamps, the metrics rows and the tables. Running them takes
minutes (ALFWorld games, two engines); their outputs are in results/bench/."""
from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from bench import env_throughput, rollout_quality
from jaxopd_envs.base import Observation, Task
from jaxopd.rollout.trajectory import Trajectory, Turn


def test_defaults_fit_a_small_machine_and_the_budget_scales_the_training_one():
    args = env_throughput.parse_args([])
    assert (args.episodes, args.max_turns, args.full_tokens, args.fast_tokens, args.b_max) == (8, 6, 128, 16, 16)
    assert args.repeats >= 2                                # alternated order needs two
    budget = env_throughput.thinking_budget(128)
    assert (budget.first_stage_tokens, budget.total_tokens, budget.second_stage_max_tokens) == (96, 128, 32)
    assert env_throughput.thinking_budget(64).first_stage_tokens == 32
    quality = rollout_quality.parse_args([])
    assert quality.tasks == 16 and quality.max_turns == 8
    assert quality.strategies == ["vanilla", "actfirst", "sti", "actionopd"]
    with pytest.raises(SystemExit):
        env_throughput.parse_args(["--episodes", "4", "--num-games", "2"])


def test_timed_pool_stamps_each_step_when_it_returns():
    class Pool:
        num_slots = 2

        def submit_step(self, slot, action):
            future = Future()
            future.set_result(action)
            return future

    pool = env_throughput.TimedPool(Pool())
    before = time.perf_counter()
    assert pool.submit_step(0, "look").result() == "look"
    assert pool.num_slots == 2 and len(pool.step_times) == 1 and pool.step_times[0] >= before


def trajectory(actions, *, won_last=False):
    task = Task(benchmark="alfworld", split="train", task_id="t", task_type="pick_and_place_simple")
    first = Observation(text="You are in a room.", instruction="Your task is to: look.", admissible_actions=("look",))
    turns = []
    for index, action in enumerate(actions, start=1):
        after = Observation(text=f"Seen {index}.", instruction=first.instruction, admissible_actions=("look",),
                            won=won_last and index == len(actions), done=won_last and index == len(actions))
        turns.append(Turn(index=index, observation=first, action=action, next_observation=after,
                          action_source="full"))
    return Trajectory(task=task, strategy="vanilla", initial_observation=first, turns=tuple(turns),
                      end_reason="done" if won_last else "max_turns")


def test_quality_rows_and_table():
    row = rollout_quality.quality_row("vanilla", [trajectory(["look", ""], won_last=True), trajectory(["", ""])],
                                      1.5)
    assert row["transitions"] == 4 and row["won"] == 1
    assert row["successful_yield"] == pytest.approx(25.0) and row["mean_turns"] == 2.0
    assert row["valid_action_rate"] == pytest.approx(0.25)
    assert row["end_reasons"] == {"done": 1, "max_turns": 1}
    empty = rollout_quality.quality_row("actionopd", [trajectory([])], 0.5)
    assert empty["successful_yield"] is None and empty["valid_action_rate"] is None and empty["mean_turns"] == 0
    result = {"config": {"tasks": 2, "max_turns": 2, "full_tokens": 64, "fast_tokens": 16},
              "student": {"name": "tiny", "random_weights": True, "weights": None},
              "teacher": {"name": "tiny", "random_weights": True, "weights": None},
              "machine": {"cpu_count": 2}, "rows": [row, empty], "note": "random", "command": "x"}
    table = rollout_quality.markdown(result)
    assert "| vanilla | 25.00 | 0.0 | 2.00 | 25.0% | done 1, max_turns 1 | 1.5 |" in table
    assert "| actionopd | – |" in table
