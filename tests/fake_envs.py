"""Picklable fake environments for EnvPool's process backend (a worker process imports this module).

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
