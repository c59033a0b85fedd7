"""EnvPool: concurrency, per-slot ordering, timeouts and crash recovery, on deterministic fake TextEnvs,
in threads and in worker processes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import os
import signal
import tempfile
import threading
import time

import numpy as np
import pytest
from fake_envs import ScriptedEnv
from fake_envs import sequential_texts as scripted_texts

from jaxopd_envs.base import EnvError, Observation, Task, TextEnv
from jaxopd_envs.pool import EngineBusyError, EnvPool, EnvTimeoutError, default_backend


def fake_task(i: int) -> Task:
    return Task(benchmark="fake", split="train", task_id=f"fake/train/{i}", task_type="fake")


class FakeEnv(TextEnv):
    """Deterministic text env: each observation is a digest of (task, actions so far).

    ``latency_s`` sleeps in every call (I/O-bound, like the real engines' 30-70 ms steps). The
    ``Faults`` object shared by the test makes a chosen (task, turn) raise or hang once, or marks an
    instance dead ("killed process"): every later call on it raises.
    """

    benchmark = "fake"

    def __init__(self, faults: "Faults", latency_s: float = 0.0, salt: str = ""):
        self.faults = faults
        self.latency_s = latency_s
        self.salt = salt
        self.dead = False
        self.closed = False
        self.calls: list[tuple] = []
        self._busy = 0
        self._task: Task | None = None
        self._actions: list[str] = []

    def tasks(self, split):
        return [fake_task(i) for i in range(4)]

    def _enter(self):
        self._busy += 1
        if self._busy > 1:
            self.faults.overlaps += 1
        with self.faults.lock:
            self.faults.active += 1
            self.faults.max_active = max(self.faults.max_active, self.faults.active)
        if self.dead:
            self._leave()
            raise EnvError("fake process is dead")

    def _leave(self):
        self._busy -= 1
        with self.faults.lock:
            self.faults.active -= 1

    def _observe(self) -> Observation:
        digest = hashlib.sha1(repr((self.salt, self._task.task_id, self._actions)).encode()).hexdigest()[:8]
        turn = len(self._actions)
        return Observation(text=f"{self._task.task_id} turn {turn} {digest}", instruction="do it",
                           admissible_actions=tuple(f"act {k}" for k in range(3)),
                           done=bool(self._actions) and self._actions[-1] == "finish",
                           won=bool(self._actions) and self._actions[-1] == "finish", turn=turn)

    def reset(self, task):
        self._enter()
        try:
            self.calls.append(("reset", task.task_id))
            time.sleep(self.latency_s)
            self._task, self._actions = task, []
            return self._observe()
        finally:
            self._leave()

    def step(self, action):
        if self._task is None:
            raise ValueError("step before reset")
        self._enter()
        try:
            self.calls.append(("step", action))
            time.sleep(self.latency_s)
            fault = self.faults.take(self._task.task_id, len(self._actions) + 1)
            if fault == "raise":
                raise RuntimeError("injected crash")
            if fault == "kill":
                self.dead = True
                raise EnvError("fake process was killed")
            if fault == "hang":
                self.faults.hanging.set()
                self.faults.release.wait(30)
                raise RuntimeError("hung call released")
            self._actions.append(action)
            return self._observe()
        finally:
            self._leave()

    def close(self):
        self.closed = True


class Faults:
    def __init__(self):
        self.lock = threading.Lock()
        self.planned: dict[tuple[str, int], str] = {}
        self.release = threading.Event()
        self.hanging = threading.Event()
        self.active = 0
        self.max_active = 0
        self.overlaps = 0
        self.instances: list[FakeEnv] = []

    def take(self, task_id, turn):
        with self.lock:
            return self.planned.pop((task_id, turn), None)

    def factory(self, latency_s=0.0, salts=None, env_class=None):
        def build():
            salt = salts.pop(0) if salts else ""
            env = (env_class or FakeEnv)(self, latency_s, salt)
            self.instances.append(env)
            return env
        return build


@pytest.fixture
def faults():
    f = Faults()
    yield f
    f.release.set()          # free any thread left hanging


ACTIONS = ["act 0", "act 1", "act 2", "act 1", "finish"]


def sequential_texts(task: Task, actions) -> list[str]:
    env = FakeEnv(Faults())
    return [env.reset(task).text] + [env.step(a).text for a in actions]


def run_pool_episodes(pool: EnvPool, num_slots: int, actions) -> None:
    for f in [pool.submit_reset(s, fake_task(s)) for s in range(num_slots)]:
        f.result()
    for action in actions:
        for f in [pool.submit_step(s, action) for s in range(num_slots)]:
            f.result()


class RendezvousEnv(FakeEnv):
    """A FakeEnv whose every call waits at a barrier shared by all slots: the calls of one round can only
    return once all of them are in flight at the same moment, so a pool that serialised them would break
    the barrier (``threading.BrokenBarrierError``) instead of finishing."""

    barrier: threading.Barrier

    def reset(self, task):
        self.barrier.wait(timeout=60)
        return super().reset(task)

    def step(self, action):
        self.barrier.wait(timeout=60)
        return super().step(action)


def test_sixteen_envs_step_concurrently(faults, monkeypatch):
    """16 slots: every reset and step of a round is in flight at once (a barrier of 16 proves it, no clock).

    The speed this buys on real environments is measured by ``bench/env_pool.py``, not here."""
    num_slots, actions = 16, ACTIONS[:4]
    monkeypatch.setattr(RendezvousEnv, "barrier", threading.Barrier(num_slots), raising=False)
    with EnvPool(faults.factory(env_class=RendezvousEnv), num_slots, max_retries=0) as pool:
        run_pool_episodes(pool, num_slots, actions)
        for s in range(num_slots):
            assert pool.trajectory(s).actions == tuple(actions)
            assert pool.trajectory(s).observations[-1].text == sequential_texts(fake_task(s), actions)[-1]
    assert faults.overlaps == 0            # and never two calls on one environment
    assert not RendezvousEnv.barrier.broken


def test_trajectories_match_sequential_runs_and_are_not_mixed(faults):
    num_slots = 6
    with EnvPool(faults.factory(latency_s=0.002), num_slots, max_workers=3) as pool:
        run_pool_episodes(pool, num_slots, ACTIONS)
        for s in range(num_slots):
            traj = pool.trajectory(s)
            assert traj.task == fake_task(s)
            assert traj.actions == tuple(ACTIONS)
            assert [o.text for o in traj.observations] == sequential_texts(fake_task(s), ACTIONS)
            assert [o.turn for o in traj.observations] == list(range(len(ACTIONS) + 1))
            assert traj.observations[-1].won and traj.recoveries == 0
    assert faults.max_active <= 3                  # bounded by max_workers
    assert faults.overlaps == 0                    # one thread per env at a time
    assert len(faults.instances) == num_slots


def test_calls_on_one_slot_run_in_submission_order(faults):
    with EnvPool(faults.factory(latency_s=0.001), 2, max_workers=4) as pool:
        pool.submit_reset(0, fake_task(7))
        futures = [pool.submit_step(0, a) for a in ACTIONS]   # queued without waiting
        texts = [f.result().text for f in futures]
    assert texts == sequential_texts(fake_task(7), ACTIONS)[1:]
    assert faults.overlaps == 0


def test_killed_env_is_rebuilt_and_replayed_with_trajectory_intact(faults):
    num_slots = 4
    with EnvPool(faults.factory(latency_s=0.001), num_slots) as pool:
        run_pool_episodes(pool, num_slots, ACTIONS[:3])
        victim = next(e for e in faults.instances if e._task == fake_task(2))
        victim.dead = True                                   # the process dies mid-episode
        for f in [pool.submit_step(s, ACTIONS[3]) for s in range(num_slots)]:
            f.result()                                       # no error reaches the caller
        pool.step(2, ACTIONS[4])
        traj = pool.trajectory(2)
        assert traj.recoveries == 1 and pool.recoveries == 1
        assert traj.actions == tuple(ACTIONS[:5])
        assert [o.text for o in traj.observations] == sequential_texts(fake_task(2), ACTIONS[:5])
        rebuilt = faults.instances[-1]
        assert len(faults.instances) == num_slots + 1 and rebuilt is not victim
        # the new env got reset + the three recorded actions, then the retried action and the next one
        assert rebuilt.calls == [("reset", fake_task(2).task_id)] + [("step", a) for a in ACTIONS[:5]]
        for s in (0, 1, 3):                                  # other slots untouched
            assert pool.trajectory(s).recoveries == 0
            assert pool.trajectory(s).observations[-1].text == sequential_texts(fake_task(s), ACTIONS[:4])[-1]
    time.sleep(0.05)
    assert victim.closed


def test_exception_in_step_is_recovered_transparently(faults):
    faults.planned[(fake_task(1).task_id, 2)] = "raise"
    with EnvPool(faults.factory(), 2) as pool:
        pool.reset(1, fake_task(1))
        observations = [pool.step(1, a) for a in ACTIONS]
        assert [o.text for o in observations] == sequential_texts(fake_task(1), ACTIONS)[1:]
        assert pool.trajectory(1).recoveries == 1


def test_hung_call_raises_after_timeout_and_env_is_rebuilt(faults):
    faults.planned[(fake_task(0).task_id, 2)] = "hang"
    with EnvPool(faults.factory(), 1, call_timeout_s=0.3, max_retries=0) as pool:
        pool.reset(0, fake_task(0))
        pool.step(0, ACTIONS[0])
        start = time.perf_counter()
        with pytest.raises(EnvTimeoutError, match="did not return within 0.3 s"):
            pool.step(0, ACTIONS[1])
        waited = time.perf_counter() - start
        assert waited > 0.25    # the call was given its time (an upper bound would time the machine)
        hung = faults.instances[0]
        # trajectory unchanged by the failed call; the next call rebuilds, replays and continues
        assert pool.trajectory(0).actions == (ACTIONS[0],)
        observation = pool.step(0, ACTIONS[1])
        assert observation.text == sequential_texts(fake_task(0), ACTIONS[:2])[-1]
        assert len(faults.instances) == 2 and faults.instances[1].calls[:2] == [
            ("reset", fake_task(0).task_id), ("step", ACTIONS[0])]
        time.sleep(0.05)
        assert hung.closed


def test_hung_call_with_retry_continues_the_episode(faults):
    faults.planned[(fake_task(3).task_id, 3)] = "hang"
    with EnvPool(faults.factory(), 1, call_timeout_s=0.3, max_retries=1) as pool:
        pool.reset(0, fake_task(3))
        texts = [pool.step(0, a).text for a in ACTIONS]
    assert texts == sequential_texts(fake_task(3), ACTIONS)[1:]


def test_replay_divergence_is_an_error_not_a_silent_mix(faults):
    """A rebuilt env whose replay gives other observations must not continue the trajectory."""
    faults.planned[(fake_task(0).task_id, 3)] = "raise"
    with EnvPool(faults.factory(salts=["", "other", "other2"]), 1, max_retries=1) as pool:
        pool.reset(0, fake_task(0))
        pool.step(0, ACTIONS[0])
        pool.step(0, ACTIONS[1])
        with pytest.raises(EnvError, match="diverged at turn 0"):
            pool.step(0, ACTIONS[2])
        assert pool.trajectory(0).actions == tuple(ACTIONS[:2])


def test_bad_input_is_value_error_and_env_kept(faults):
    with EnvPool(faults.factory(), 2) as pool:
        with pytest.raises(ValueError, match="before a successful reset"):
            pool.step(0, "act 0")
        with pytest.raises(ValueError, match="slot must be an int"):
            pool.submit_step(2, "act 0")
        with pytest.raises(ValueError, match="action must be a str"):
            pool.submit_step(0, 3)
        with pytest.raises(ValueError, match="task must be"):
            pool.submit_reset(0, "fake/train/0")
        pool.reset(0, fake_task(0))
        assert pool.recoveries == 0 and len(faults.instances) == 1
    with pytest.raises(ValueError, match="num_slots"):
        EnvPool(faults.factory(), 0)


def test_asyncio_forms(faults, monkeypatch):
    num_slots = 5

    async def episode(pool, slot):
        observation = await pool.areset(slot, fake_task(slot))
        texts = [observation.text]
        for action in ACTIONS:
            texts.append((await pool.astep(slot, action)).text)
        return texts

    async def main(pool):
        return await asyncio.gather(*(episode(pool, s) for s in range(num_slots)))

    monkeypatch.setattr(RendezvousEnv, "barrier", threading.Barrier(num_slots), raising=False)
    with EnvPool(faults.factory(env_class=RendezvousEnv), num_slots, max_retries=0) as pool:
        results = asyncio.run(main(pool))
    for s, texts in enumerate(results):
        assert texts == sequential_texts(fake_task(s), ACTIONS)
    assert not RendezvousEnv.barrier.broken   # every round met at the barrier: concurrent, not serial


def test_close_fails_queued_calls_and_closes_envs(faults):
    faults.planned[(fake_task(0).task_id, 1)] = "hang"
    pool = EnvPool(faults.factory(), 1, call_timeout_s=0.3, max_retries=0)
    pool.reset(0, fake_task(0))
    first = pool.submit_step(0, "act 0")            # hangs until the timeout
    queued = pool.submit_step(0, "act 1")
    assert faults.hanging.wait(5)                   # ``first`` is running, ``queued`` waits behind it
    pool.close()
    with pytest.raises(EnvTimeoutError):
        first.result()
    with pytest.raises(EnvError, match="closed"):
        queued.result()
    with pytest.raises(EnvError, match="closed"):
        pool.submit_step(0, "act 0")
    time.sleep(0.05)
    assert all(e.closed for e in faults.instances)


class ReorderingEnv(FakeEnv):
    """Like ScienceWorld after a reset: same objects, listed in another order by each new instance."""

    benchmark = "scienceworld"

    def _observe(self) -> Observation:
        base = super()._observe()
        items = [f"a cup (containing {self.salt or 'water'})", "a drawer", f"turn {len(self._actions)}"]
        if self.salt == "reordered":
            items = ["a drawer", "a cup (containing water)", f"turn {len(self._actions)}"]
        history = f"{self._task.task_id} after {'|'.join(self._actions)}"      # no salt: same state
        return Observation(text="on the table is: " + ", ".join(items) + ".\nyou also see:\n" + history,
                           instruction=base.instruction, turn=base.turn)


def test_default_replay_check_uses_the_benchmark_normal_form(faults):
    def factory(salts):
        def build():
            env = ReorderingEnv(faults, 0.0, salts.pop(0))
            faults.instances.append(env)
            return env
        return build

    faults.planned[(fake_task(0).task_id, 2)] = "raise"
    with EnvPool(factory(["", "reordered"]), 1) as pool:            # enumeration reordered: same state
        pool.reset(0, fake_task(0))
        texts = [pool.step(0, a).text for a in ACTIONS[:3]]
        assert pool.trajectory(0).recoveries == 1 and texts[1].startswith("on the table is: a drawer, a cup")

    faults.planned[(fake_task(0).task_id, 2)] = "raise"
    exact = EnvPool(factory(["", "reordered", "reordered"]), 1,
                    verify_replay=lambda recorded, replayed: recorded.text == replayed.text)
    with exact, pytest.raises(EnvError, match="diverged at turn 0"):
        exact.reset(0, fake_task(0))
        for action in ACTIONS[:3]:
            exact.step(0, action)

    faults.planned[(fake_task(0).task_id, 2)] = "raise"
    with EnvPool(factory(["", "milk", "milk"]), 1) as changed, pytest.raises(EnvError, match="diverged"):
        changed.reset(0, fake_task(0))                                # another object: not the same state
        for action in ACTIONS[:3]:
            changed.step(0, action)


# ------------------------------------------------------------------------- closing, timeouts, inputs


def _race_submits_against_close(pool: EnvPool, pause_s: float):
    """Two threads submit steps as fast as they can while close() runs; returns what they got."""
    futures: list[concurrent.futures.Future] = []
    refused: list[BaseException] = []
    go = threading.Event()

    def submitter(slot):
        go.wait()
        for _ in range(30):
            try:
                futures.append(pool.submit_step(slot, "act 0"))
            except Exception as error:  # noqa: BLE001 - EnvError("pool closed") or, before the fix, RuntimeError
                refused.append(error)

    threads = [threading.Thread(target=submitter, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    go.set()
    time.sleep(pause_s)
    pool.close()
    for thread in threads:
        thread.join(10)
    return futures, refused


def test_submit_racing_close_never_loses_a_future(faults):
    """Issue 15.12: submits racing close() either raise EnvError("pool closed") or return a future that ends."""
    unfinished, bad_endings = 0, []
    for attempt in range(100):
        pool = EnvPool(faults.factory(), 2, max_workers=2)
        pool.reset(0, fake_task(0))
        pool.reset(1, fake_task(1))
        futures, refused = _race_submits_against_close(pool, 0.0002 * (attempt % 5))
        done, not_done = concurrent.futures.wait(futures, timeout=5)
        unfinished += len(not_done)
        endings = refused + [f.exception() for f in done if f.exception() is not None]
        bad_endings += [e for e in endings if not (isinstance(e, EnvError) and "pool closed" in str(e))]
    assert unfinished == 0 and bad_endings == []


class LockedEnv(FakeEnv):
    """Like ALFWorld in threads: every call of every instance holds one process-wide engine lock."""

    call_lock = threading.RLock()

    def reset(self, task):
        with self.call_lock:
            return super().reset(task)

    def step(self, action):
        with self.call_lock:
            return super().step(action)


class BusyEnv(LockedEnv):
    call_lock = threading.RLock()


def test_timeout_counts_the_call_not_the_wait_for_a_shared_engine_lock(faults):
    """Issue 15.13: six slots resetting at once behind one engine lock, timeout 3x one reset: none times out."""
    latency = 0.2
    with EnvPool(faults.factory(latency, env_class=LockedEnv), 6, call_timeout_s=3 * latency, max_retries=0) as pool:
        futures = [pool.submit_reset(slot, fake_task(slot)) for slot in range(6)]
        observations = [future.result() for future in futures]
        assert [o.text for o in observations] == [sequential_texts(fake_task(s), [])[0] for s in range(6)]
        assert pool.recoveries == 0
    assert len(faults.instances) == 6 and faults.overlaps == 0


def test_a_call_that_cannot_get_its_engine_never_runs_and_keeps_the_env(faults):
    with EnvPool(faults.factory(env_class=BusyEnv), 1, call_timeout_s=0.2) as pool:
        pool.reset(0, fake_task(0))
        with BusyEnv.call_lock:                     # another user holds the engine past every bound
            with pytest.raises(EngineBusyError, match="could not start"):
                pool.step(0, "act 0")
        assert pool.step(0, "act 1").text == sequential_texts(fake_task(0), ["act 1"])[-1]
        assert pool.recoveries == 0 and len(faults.instances) == 1
        assert faults.instances[0].calls == [("reset", fake_task(0).task_id), ("step", "act 1")]


def test_slots_and_counts_are_ints_not_bools(faults):
    """Issue 15.19: slot True is not slot 1, while numpy's integers are slots."""
    with EnvPool(faults.factory(), 2) as pool:
        assert pool.reset(np.int64(1), fake_task(1)).text == sequential_texts(fake_task(1), [])[0]
        assert pool.step(np.int32(1), "act 0").turn == 1
        assert pool.trajectory(np.int64(1)).slot == 1
        for bad in (True, False, 1.0, "0", None):
            with pytest.raises(ValueError, match="slot must be an int"):
                pool.submit_step(bad, "act 0")
    for bad in (True, 2.0, "2"):
        with pytest.raises(ValueError, match="num_slots"):
            EnvPool(faults.factory(), bad)
    with pytest.raises(ValueError, match="max_retries"):
        EnvPool(faults.factory(), 1, max_retries=True)
    with pytest.raises(ValueError, match="call_timeout_s"):
        EnvPool(faults.factory(), 1, call_timeout_s=True)


# ------------------------------------------------------------------------------ the process backend


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not). A process reaped between the open and the read of its
    ``/proc`` entry raises ProcessLookupError there (seen in CI): it is gone too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_backend_is_chosen_per_benchmark():
    from jaxopd_envs.alfworld import AlfWorldEnv
    from jaxopd_envs.scienceworld import ScienceWorldEnv

    assert default_backend(functools.partial(AlfWorldEnv, "/games")) == "process"
    assert default_backend(AlfWorldEnv) == "process"
    assert default_backend(functools.partial(functools.partial(ScienceWorldEnv), max_restarts=0)) == "thread"
    assert default_backend(lambda: AlfWorldEnv("/games")) == "thread"     # a lambda cannot reach a process
    with pytest.raises(ValueError, match="picklable"):
        EnvPool(lambda: ScriptedEnv(), 1, backend="process")
    with pytest.raises(ValueError, match="never 'fork'"):
        EnvPool(ScriptedEnv, 1, backend="process", start_method="fork")
    with pytest.raises(ValueError, match="backend must be"):
        EnvPool(ScriptedEnv, 1, backend="processes")


def test_worker_processes_give_the_thread_observations(faults):
    """Three slots on two worker processes (slots 0 and 2 share one): same texts as a sequential run."""
    with EnvPool(ScriptedEnv, 3, backend="process", max_workers=2) as pool:
        assert pool.backend == "process" and pool.max_workers == 2
        for future in [pool.submit_reset(s, fake_task(s)) for s in range(3)]:
            future.result()
        futures = {s: [pool.submit_step(s, a) for a in ACTIONS] for s in range(3)}
        for slot, slot_futures in futures.items():
            assert [f.result().text for f in slot_futures] == scripted_texts(fake_task(slot), ACTIONS)[1:]
            trajectory = pool.trajectory(slot)
            assert [o.text for o in trajectory.observations] == scripted_texts(fake_task(slot), ACTIONS)
            assert trajectory.recoveries == 0
        pids = [pool.trajectory(s).observations[-1].info["pid"] for s in range(3)]
        assert pids[0] == pids[2] != pids[1] and sorted(set(pids)) == sorted(pool.worker_pids)
        assert os.getpid() not in pids
        with pytest.raises(ValueError, match="episode is over"):       # bad input crosses the process as is
            pool.step(0, "act 0")
        assert pool.recoveries == 0


def test_killed_worker_process_is_replayed_for_each_of_its_slots():
    with EnvPool(ScriptedEnv, 3, backend="process", max_workers=2) as pool:
        for slot in range(3):
            pool.reset(slot, fake_task(slot))
            for action in ACTIONS[:2]:
                pool.step(slot, action)
        victim = pool.worker_pids[pool.worker_of(0)]
        os.kill(victim, signal.SIGKILL)
        assert _wait_until(lambda: not _alive(victim))
        for slot in range(3):
            for action in ACTIONS[2:]:
                pool.step(slot, action)
            trajectory = pool.trajectory(slot)
            assert trajectory.actions == tuple(ACTIONS)
            assert [o.text for o in trajectory.observations] == scripted_texts(fake_task(slot), ACTIONS)
        assert [pool.trajectory(s).recoveries for s in range(3)] == [1, 0, 1]     # slots 0 and 2 lived there
        assert victim not in pool.worker_pids and all(_alive(p) for p in pool.worker_pids)


def test_hung_call_in_a_worker_is_stopped_not_left_running():
    """Issue 15.13: an abandoned call does not run on; its worker process is stopped and the slot replayed."""
    with EnvPool(ScriptedEnv, 1, backend="process", max_workers=1, call_timeout_s=1.0, max_retries=0) as pool:
        pool.reset(0, fake_task(0))
        pool.step(0, "act 0")
        hung = pool.worker_pids[0]
        with pytest.raises(EnvTimeoutError, match="did not return within 1 s"):
            pool.step(0, "hang")
        assert _wait_until(lambda: not _alive(hung), 5)
        assert pool.step(0, "act 1").text == scripted_texts(fake_task(0), ["act 0", "act 1"])[-1]
        assert pool.trajectory(0).recoveries == 1 and pool.worker_pids[0] != hung


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_close_leaves_no_worker_thread_or_temp_folder(backend):
    time.sleep(0.1)
    threads_before = set(threading.enumerate())
    temp_before = set(os.listdir(tempfile.gettempdir()))
    pool = EnvPool(ScriptedEnv, 3, backend=backend, max_workers=2, call_timeout_s=30)
    run_pool_episodes(pool, 3, ACTIONS[:2])
    pids = [p for p in pool.worker_pids if p is not None]
    assert len(pids) == (2 if backend == "process" else 0)
    pool.close()
    pool.close()
    assert not any(_alive(pid) for pid in pids)
    assert _wait_until(lambda: set(threading.enumerate()) <= threads_before, 5), \
        [t.name for t in set(threading.enumerate()) - threads_before]
    assert set(os.listdir(tempfile.gettempdir())) - temp_before == set()
    with pytest.raises(EnvError, match="pool closed"):
        pool.submit_reset(0, fake_task(0))
