"""Picklable fake environments for EnvPool's process backend (a worker process imports this module), and the
corridor the rollout, loop and Llama tests play.

``ScriptedEnv`` is deterministic: each observation is a digest of (task, actions so far). Some actions
act on the process itself, so a test can drive a worker without shared memory: ``"hang"`` sleeps for a
minute, ``"exit"`` kills the process (as a native crash would), ``"pid"`` is an ordinary step whose
observation's ``info["pid"]`` (present on every observation) says where the environment lives.
"""
from __future__ import annotations

import hashlib
import os
import time

from jaxopd_envs.base import Observation, Task, TextEnv


def fake_task(i: int) -> Task:
    return Task(benchmark="fake", split="train", task_id=f"fake/train/{i}", task_type="fake")


class ScriptedEnv(TextEnv):
    benchmark = "fake"

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s
        self._task: Task | None = None
        self._actions: list[str] = []

    def tasks(self, split):
        return [fake_task(i) for i in range(4)]

    def _observe(self) -> Observation:
        digest = hashlib.sha1(repr((self._task.task_id, self._actions)).encode()).hexdigest()[:8]
        finished = bool(self._actions) and self._actions[-1] == "finish"
        return Observation(text=f"{self._task.task_id} turn {len(self._actions)} {digest}", instruction="do it",
                           admissible_actions=("act 0", "act 1", "finish"), done=finished, won=finished,
                           turn=len(self._actions), info={"pid": os.getpid()})

    def reset(self, task):
        time.sleep(self.latency_s)
        self._task, self._actions = task, []
        return self._observe()

    def step(self, action):
        if self._task is None:
            raise ValueError("step before reset")
        if self._actions and self._actions[-1] == "finish":
            raise ValueError("episode is over")
        time.sleep(self.latency_s)
        if action == "hang":
            time.sleep(60)
        if action == "exit":
            os._exit(17)
        self._actions.append(action)
        return self._observe()


def sequential_texts(task: Task, actions) -> list[str]:
    env = ScriptedEnv()
    return [env.reset(task).text] + [env.step(a).text for a in actions]


# ----------------------------------------------------------------------------------------------------- corridor
CORRIDOR_WALKTHROUGH = ("go forward", "go forward", "take key", "go forward", "open door")


class CorridorEnv(TextEnv):
    """Spots 0..3; the key lies at spot 2, the door is at spot 3. Invalid actions: "Nothing happens."."""

    benchmark = "alfworld"

    def __init__(self):
        self.position, self.has_key, self.turn, self.won = 0, False, 0, False
        self.resets = 0

    def tasks(self, split):
        return [corridor_task(i) for i in range(3)]

    def walkthrough(self, task):
        return list(CORRIDOR_WALKTHROUGH)

    def _admissible(self):
        actions = ["go forward", "go back", "look", "inventory"]
        if self.position == 2 and not self.has_key:
            actions.append("take key")
        if self.position == 3 and self.has_key:
            actions.append("open door")
        return tuple(actions)

    def _observe(self, text, valid=True):
        return Observation(text=text, instruction="Your task is to: open the door.",
                           admissible_actions=self._admissible(), done=self.won, won=self.won,
                           score=float(self.won), reward=float(self.won), turn=self.turn, last_action_valid=valid)

    def reset(self, task):
        self.position, self.has_key, self.turn, self.won = 0, False, 0, False
        self.resets += 1
        return self._observe("You are at the start of a corridor.")

    def step(self, action):
        self.turn += 1
        command = " ".join(action.lower().split())
        if command not in self._admissible():
            return self._observe("Nothing happens.", valid=False)
        if command == "go forward":
            self.position = min(self.position + 1, 3)
            return self._observe(f"You walk to spot {self.position}.")
        if command == "go back":
            self.position = max(self.position - 1, 0)
            return self._observe(f"You walk back to spot {self.position}.")
        if command == "look":
            return self._observe(f"You are at spot {self.position}.")
        if command == "inventory":
            return self._observe("You carry a key." if self.has_key else "You carry nothing.")
        if command == "take key":
            self.has_key = True
            return self._observe("You take the key.")
        self.won = True
        return self._observe("You open the door.")


def corridor_task(index: int = 0) -> Task:
    return Task(benchmark="alfworld", split="train", task_id=f"corridor/train/{index}",
                task_type="pick_and_place_simple")
