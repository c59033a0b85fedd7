"""The paired Vanilla / ActFirst virtual-turn protocol of the rollout-speedup experiment (paper App. C.5), run by
the rollout strategies that training runs.

Owns the fixed-context environment (``FixedContextEnv``: every step returns the task's initial context), the
batch driver (``run_batch``: one batch of tasks for T virtual turns, played by ``jaxopd.rollout.strategies``'
``vanilla`` and ``actfirst`` strategies over a ``jaxopd_envs.pool.EnvPool`` of fixed contexts), the check of a
batch's recorded engine events against the protocol (``check_schedule``), the single-request latency
calibration (``calibrate_latencies``) and paired, order-alternated repeats over batches (``run_paired_point``).
It works with any ``jaxopd.sampler.EngineProtocol`` (``submit`` → future, ``max_concurrency``, ``wait_idle``,
``events``): ``jaxopd.sampler.Engine`` or ``jaxopd.sampler.SimulatedEngine``. Times come from the engine's own
``Result.timings``, so they cover queueing, prefill, decoding and scheduling and exclude tokenisation (prompts
are tokenised once, before timing).

One batch of N tasks, each with its own fixed context, for T virtual turns: ``RolloutStrategy.collect`` plays
the N episodes concurrently (one host thread per episode, the environments stepped in the pool's threads),
each episode ``max_turns = T`` turns long. The strategies run with ``RolloutConfig.fixed_output_lengths``:
every request generates exactly its length (16-token fast actions, 128- or 512-token full responses; no stop
strings, no thinking-budget insertion), sampling at temperature 1, top-p 1, no top-k.

* **Vanilla** (``VanillaStrategy``): each turn is one full response; the task executes its (empty) action and
  submits turn t+1 when it returns. A task never has two requests in flight.
* **ActFirst** (``ActFirstStrategy``, the ``no-id`` configuration: App. C.5's fast actions use the action-only
  prompt without reference information): at each turn the fast action and the full response are submitted
  together, the fast one first; the fast action's return releases the next turn, while full responses of
  earlier turns keep decoding. The episode ends when all its full responses returned.

A batch ends when all its requests have finished; its completion time runs from its first submission to its
last finish. The driver adds nothing to the strategies but the fixed prompts (pre-tokenised, read from the task)
and the request names ``<tag>/task<i>/turn<t>/<kind>`` that ``check_schedule`` reads. On a virtual-clock engine
(``SimulatedEngine``, which simulates inside ``wait_idle`` on the calling thread) the driver's request bridge
keeps the clock still while a released task steps its environment and submits its next turn, so virtual
times are those of an instantaneous host, as Proposition 1 assumes.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import statistics
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from jaxopd_envs.base import Observation, Task, TextEnv
from jaxopd_envs.pool import EnvPool
from jaxopd.rollout.strategies import ActFirstStrategy, RolloutConfig, RolloutStrategy, VanillaStrategy, actfirst_config
from jaxopd.rollout.strategies import request_seed as rollout_request_seed
from jaxopd.rollout.thinking import ThinkingBudget
from jaxopd.sampler import Request, SamplingParams

Strategy = Literal["vanilla", "actfirst"]
STRATEGIES: tuple[str, ...] = ("vanilla", "actfirst")
KINDS: tuple[str, ...] = ("fast", "full")
DEFAULT_BATCH_TIMEOUT_S = 3 * 3600.0
DRIVER = ("jaxopd.rollout.strategies: VanillaStrategy and ActFirstStrategy (no-id: fast actions by next-action "
          "prediction) with RolloutConfig.fixed_output_lengths, RolloutStrategy.collect over a "
          "jaxopd_envs.pool.EnvPool of FixedContextEnv (one host thread per episode; environments in the pool's "
          "threads)")
"""What plays the batches, in words (``results.json`` records it)."""


# ----------------------------------------------------------------------------------------------- inputs
@dataclasses.dataclass(frozen=True)
class TaskContext:
    """One task's fixed interaction context, tokenised for both request kinds.

    ``index`` is the context's position in the sampled list (it seeds its requests); ``full_prompt_ids`` is
    the think-then-act prompt, ``fast_prompt_ids`` the action-only prompt.
    """

    index: int
    context_id: str
    task_type: str
    full_prompt_ids: tuple[int, ...]
    fast_prompt_ids: tuple[int, ...]

    def __post_init__(self):
        if not self.full_prompt_ids or not self.fast_prompt_ids:
            raise ValueError(f"context {self.context_id!r} has an empty prompt")
        object.__setattr__(self, "full_prompt_ids", tuple(int(t) for t in self.full_prompt_ids))
        object.__setattr__(self, "fast_prompt_ids", tuple(int(t) for t in self.fast_prompt_ids))

    def prompt_ids(self, kind: str) -> tuple[int, ...]:
        return self.fast_prompt_ids if kind == "fast" else self.full_prompt_ids


@dataclasses.dataclass(frozen=True)
class Workload:
    """Fixed output lengths (``min_new_tokens == max_new_tokens``) and sampling settings of App. C.5 Table 8."""

    fast_tokens: int = 16
    full_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        for name in ("fast_tokens", "full_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")
        SamplingParams(max_new_tokens=1, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k).validate()

    def tokens(self, kind: str) -> int:
        if kind not in KINDS:
            raise ValueError(f"request kind must be one of {KINDS}, got {kind!r}")
        return self.fast_tokens if kind == "fast" else self.full_tokens

    def sampling_params(self, kind: str, seed: int) -> SamplingParams:
        n = self.tokens(kind)
        return SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=seed)


ROLES: dict[str, str] = {"fast": "next_action", "full": "full"}
"""The strategies' seed role of each request kind (``RolloutStrategy.seed``): ActFirst's fast action is a
next-action prediction, and both strategies seed their full responses under the role ``full``."""


def context_task_id(context_index: int) -> str:
    """The task id of a fixed context in the rollouts: a function of its index only, so that both strategies
    and every repeat draw the same seeds for it (the strategies seed by task id, turn and role)."""
    return f"fixed-context/{int(context_index)}"


def request_seed(base_seed: int, context_index: int, turn: int, kind: str) -> int:
    """The sampling seed of one request (0-based virtual ``turn``): the seed the strategies give it
    (``jaxopd.rollout.strategies.request_seed`` of the context's task id, turn and role), a function of the
    context, the turn and the kind only, so both strategies and every repeat sample their full responses with
    the same seeds, and calibration measures the first turn's requests."""
    if kind not in KINDS:
        raise ValueError(f"request kind must be one of {KINDS}, got {kind!r}")
    return rollout_request_seed(base_seed, context_task_id(context_index), turn + 1, ROLES[kind])


# ------------------------------------------------------------------------------------ fixed contexts
class FixedContextEnv(TextEnv):
    """A text environment whose every step returns the task's initial context again (App. C.5's "fixed
    interaction contexts"): the task's payload holds the context; nothing ends an episode but the turn limit.

    Prompts are read from the task (``payload["prompt_ids"]``, tokenised once before timing), so the
    observation text only names the context.
    """

    benchmark = "alfworld"

    def __init__(self):
        self._observation: Observation | None = None

    def tasks(self, split: str) -> Sequence[Task]:
        return ()                  # the tasks are made from contexts (``context_task``), not listed here

    def reset(self, task: Task) -> Observation:
        self._observation = Observation(text=f"fixed context {task.payload['context_id']}", instruction="",
                                        info={"position": task.payload["position"]})
        return self._observation

    def step(self, action: str) -> Observation:
        if self._observation is None:
            raise ValueError("step() before reset()")
        self._observation = dataclasses.replace(self._observation, turn=self._observation.turn + 1)
        return self._observation


def context_task(context: TaskContext, position: int) -> Task:
    """The rollout task of ``context`` at ``position`` in its batch: its prompts by generation mode (``full``:
    think-then-act, ``next_action``: action-only without reference) in the payload."""
    return Task(benchmark=FixedContextEnv.benchmark, split="train", task_id=context_task_id(context.index),
                task_type=context.task_type,
                payload={"position": position, "context_id": context.context_id,
                         "prompt_ids": {"full": context.full_prompt_ids, "next_action": context.fast_prompt_ids}})


def rollout_config(strategy: str, T: int, workload: Workload, base_seed: int) -> RolloutConfig:
    """The strategies' configuration for ``T`` virtual turns of ``workload``: fixed output lengths (App. C.5);
    ActFirst without inverse dynamics (its fast actions use the action-only prompt without reference)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    common = dict(max_turns=T, thinking_budget=ThinkingBudget(workload.full_tokens, workload.full_tokens),
                  temperature=workload.temperature, top_p=workload.top_p, top_k=workload.top_k, seed=base_seed,
                  fixed_output_lengths=True)
    if strategy == "vanilla":
        return RolloutConfig(**common)
    return actfirst_config("no-id", fast_action_max_tokens=workload.fast_tokens, **common)


# ---------------------------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One finished request of a batch run; times in the engine's clock (seconds)."""

    request_id: str
    task: int                      # position of the task in its batch
    turn: int                      # 0-based virtual turn
    kind: str
    submitted_at: float
    admitted_at: float
    first_token_at: float
    finished_at: float
    num_tokens: int
    num_preemptions: int


@dataclasses.dataclass(frozen=True)
class BatchRun:
    """All requests of one batch under one strategy, with its completion time."""

    strategy: str
    T: int
    b_max: int
    context_indices: tuple[int, ...]
    records: tuple[RequestRecord, ...]
    wall_time: float               # host perf_counter around the run (sanity check only)
    schedule: ScheduleCheck | None = None     # set when the run's recorded events were checked
    num_samples: int = 0           # training responses the strategy's trajectories hold (Vanilla and ActFirst: N·T)

    @property
    def started_at(self) -> float:
        return min(r.submitted_at for r in self.records)

    @property
    def finished_at(self) -> float:
        return max(r.finished_at for r in self.records)

    @property
    def completion_time(self) -> float:
        """From the batch's first submission to its last finish, in the engine's clock."""
        return self.finished_at - self.started_at

    @property
    def peak_concurrency(self) -> int:
        """Most requests admitted and unfinished at once (a finish frees its slot before a same-time admit)."""
        return peak_concurrency((r.admitted_at, r.finished_at) for r in self.records)


class ScheduleViolation(RuntimeError):
    """Recorded engine events contradict the protocol (wrong gating, overlapping Vanilla turns, cap exceeded)."""


@dataclasses.dataclass(frozen=True)
class ScheduleCheck:
    """What ``check_schedule`` found in a batch's events."""

    num_events: int
    peak_concurrency: int                  # most requests admitted and unfinished at once, in event order
    max_full_in_flight_per_task: int       # most full responses one task had submitted and unfinished


def parse_request_id(request_id: str) -> tuple[str, int, int, str]:
    """``(tag, task, turn, kind)`` of an id made by ``run_batch``: ``<tag>/task<i>/turn<t>/<kind>``."""
    try:
        tag, task, turn, kind = request_id.rsplit("/", 3)
        if not (task.startswith("task") and turn.startswith("turn") and kind in KINDS):
            raise ValueError
        return tag, int(task[4:]), int(turn[4:]), kind
    except ValueError:
        raise ValueError(f"{request_id!r} is not a request id of run_batch") from None


def check_schedule(events: Sequence[Any], strategy: str, *, tag: str, T: int, num_tasks: int,
                   b_max: int) -> ScheduleCheck:
    """Verify a batch's recorded engine events (``EngineEvent(time, event, request_id, kind)``, in the order
    the engine recorded them) against the protocol; raise ``ScheduleViolation`` naming the first breach.

    Both strategies: every request of the batch is submitted, admitted and finished once; admitted and
    unfinished requests never exceed ``b_max``. Vanilla: full responses only; a task's turn t+1 is submitted
    after (in time and in event order) its turn-t full response finished, so a task never has two requests in
    flight. ActFirst: a turn's fast and full requests are submitted together (one right after the other among
    the task's submissions), and turn t+1's after turn t's fast action finished.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    mine = [e for e in events if e.request_id.startswith(tag + "/")]
    life: dict[tuple[int, int, str], dict[str, tuple[float, int]]] = {}
    running = peak = 0
    in_flight: dict[int, int] = {}
    full_in_flight: dict[int, int] = {}
    most_full = 0
    for position, e in enumerate(mine):
        _, task, turn, kind = parse_request_id(e.request_id)
        if e.event not in ("submit", "admit", "finish"):
            if e.event in ("preempt", "abort"):
                raise ScheduleViolation(f"{e.request_id}: unexpected {e.event} event")
            continue
        record = life.setdefault((task, turn, kind), {})
        if e.event in record:
            raise ScheduleViolation(f"{e.request_id}: two {e.event} events")
        record[e.event] = (e.time, position)
        if e.event == "admit":
            running += 1
            if running > b_max:
                raise ScheduleViolation(f"{running} requests admitted at once under b_max={b_max} "
                                        f"(at {e.request_id})")
            peak = max(peak, running)
        elif e.event == "finish":
            running -= 1
        step = {"submit": 1, "finish": -1}.get(e.event, 0)
        in_flight[task] = in_flight.get(task, 0) + step
        if strategy == "vanilla" and in_flight[task] > 1:
            raise ScheduleViolation(f"Vanilla task {task} has {in_flight[task]} requests in flight at {e.request_id}")
        if kind == "full":
            full_in_flight[task] = full_in_flight.get(task, 0) + step
            most_full = max(most_full, full_in_flight[task])
    kinds = ("full",) if strategy == "vanilla" else KINDS
    expected = {(i, t, k) for i in range(num_tasks) for t in range(T) for k in kinds}
    if set(life) != expected:
        missing, extra = sorted(expected - set(life)), sorted(set(life) - expected)
        raise ScheduleViolation(f"requests missing {missing[:3]} / unexpected {extra[:3]} in the events of {tag}")
    for key, record in life.items():
        if set(record) != {"submit", "admit", "finish"}:
            raise ScheduleViolation(f"{tag} {key}: events {sorted(record)} instead of submit, admit, finish")
    gate_kind = "full" if strategy == "vanilla" else "fast"
    submit_order: dict[int, list[tuple[int, str]]] = {i: [] for i in range(num_tasks)}
    for key, _record in sorted(life.items(), key=lambda kv: kv[1]["submit"][1]):
        submit_order[key[0]].append((key[1], key[2]))
    for i in range(num_tasks):
        for t in range(T):
            if strategy == "actfirst":
                order = submit_order[i]
                if order.index((t, "full")) != order.index((t, "fast")) + 1:
                    raise ScheduleViolation(f"{tag} task {i} turn {t}: fast and full not submitted together")
            if t == 0:
                continue
            gate_time, gate_pos = life[(i, t - 1, gate_kind)]["finish"]
            for k in kinds:
                submit_time, submit_pos = life[(i, t, k)]["submit"]
                if submit_time < gate_time or submit_pos < gate_pos:
                    raise ScheduleViolation(f"{tag} task {i} turn {t} {k} submitted before turn {t - 1}'s "
                                            f"{gate_kind} request finished")
    return ScheduleCheck(num_events=len(mine), peak_concurrency=peak, max_full_in_flight_per_task=most_full)


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Largest number of overlapping ``[start, end)`` intervals."""
    points = []
    for start, end in intervals:
        points.append((start, 1))
        points.append((end, -1))
    points.sort(key=lambda p: (p[0], p[1]))      # at equal times, -1 (finish) before +1 (admit)
    level = peak = 0
    for _, delta in points:
        level += delta
        peak = max(peak, level)
    return peak


# ---------------------------------------------------------------------------------------------- driver
class _RequestBridge:
    """The strategies' engine in one timed batch: names every request after its task, virtual turn and kind
    (``<tag>/task<i>/turn<t>/<kind>``), records its timings, and, on a virtual-clock engine, hands requests to
    the simulation at the protocol's instants.

    The task and turn come from the episode whose ``decide`` runs on the submitting thread (``local.episode``,
    set by ``_FixedContextTurns``). A ``SimulatedEngine`` advances its clock inside ``wait_idle`` on the
    driver's thread, where request completions run their callbacks; there, the completion of a request that
    releases a turn (Vanilla: the full response; ActFirst: the fast action) waits until the released episode
    has queued its next turn's requests and submits them at that same virtual instant. The real engine gets
    every request directly from the episode thread.
    """

    def __init__(self, engine: Any, *, strategy: str, T: int, num_tasks: int, workload: Workload, tag: str,
                 virtual: bool, timeout: float):
        self.engine = engine
        self.strategy = strategy
        self.T = T
        self.workload = workload
        self.tag = tag
        self.virtual = virtual
        self.timeout = timeout
        self.per_turn = 1 if strategy == "vanilla" else 2
        self.gate_kind = "full" if strategy == "vanilla" else "fast"
        self.local = threading.local()
        self.condition = threading.Condition()
        self.queued: dict[int, list[tuple[int, Request, Future]]] = {i: [] for i in range(num_tasks)}
        self.ended: set[int] = set()
        self.records: list[RequestRecord] = []
        self.errors: list[str] = []

    # -- the engine surface the strategies use (episode threads)
    def submit(self, request: Request) -> Future:
        episode = getattr(self.local, "episode", None)
        if episode is None:
            raise RuntimeError("a request was submitted outside a strategy's turn")
        task, turn = episode.task.payload["position"], episode.turn - 1
        request.request_id = f"{self.tag}/task{task}/turn{turn}/{request.kind}"
        if not self.virtual:
            future = self.engine.submit(request)
            future.add_done_callback(functools.partial(self._record, task, turn, request))
            return future
        proxy: Future = Future()
        with self.condition:
            self.queued[task].append((turn, request, proxy))
            self.condition.notify_all()
        return proxy

    def episode_ended(self, task: int) -> None:
        with self.condition:
            self.ended.add(task)
            self.condition.notify_all()

    # -- virtual clock (the thread that runs the simulation)
    def release(self, task: int, turn: int) -> None:
        """Submit ``task``'s requests of ``turn`` once its episode has queued all of them (or ended)."""
        deadline = time.monotonic() + self.timeout
        with self.condition:
            while (sum(1 for t, _, _ in self.queued[task] if t == turn) < self.per_turn
                   and task not in self.ended):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.errors.append(f"{self.tag}: task {task} did not submit turn {turn} within {self.timeout} s")
                    return
                self.condition.wait(left)
            ready = [q for q in self.queued[task] if q[0] == turn]
            self.queued[task] = [q for q in self.queued[task] if q[0] != turn]
        for _, request, proxy in ready:
            try:
                future = self.engine.submit(request)
            except Exception as exc:  # noqa: BLE001 - delivered to the episode through its future
                proxy.set_exception(exc)
                continue
            future.add_done_callback(functools.partial(self._on_virtual_done, task, turn, request, proxy))

    def release_first_turns(self) -> None:
        for task in self.queued:
            self.release(task, 0)

    def _on_virtual_done(self, task: int, turn: int, request: Request, proxy: Future, future: Future) -> None:
        self._record(task, turn, request, future)
        if future.exception() is not None:
            proxy.set_exception(future.exception())
        else:
            proxy.set_result(future.result())       # wakes the episode (through the strategy's callbacks)
        if request.kind == self.gate_kind and turn + 1 < self.T:
            self.release(task, turn + 1)             # the clock stands still until the released turn is submitted

    def fail_unreleased(self) -> list[str]:
        """Fail the requests no turn released (a protocol breach) so their episodes end; their ids."""
        with self.condition:
            stranded = [(request, proxy) for queue in self.queued.values() for _, request, proxy in queue]
            for queue in self.queued.values():
                queue.clear()
        for request, proxy in stranded:
            proxy.set_exception(RuntimeError(f"{request.request_id} was never released to the engine"))
        return [request.request_id for request, _ in stranded]

    # -- records
    def _record(self, task: int, turn: int, request: Request, future: Future) -> None:
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001
            self._error(f"{request.request_id} failed: {exc!r}")
            return
        expected = self.workload.tokens(request.kind)
        if result.finish_reason not in ("length", "stop") or len(result.token_ids) != expected:
            self._error(f"{request.request_id} ended with {result.finish_reason!r} after {len(result.token_ids)} "
                        f"tokens; the protocol fixes {expected}")
            return
        t = result.timings
        record = RequestRecord(request_id=request.request_id, task=task, turn=turn, kind=request.kind,
                               submitted_at=t.submitted_at, admitted_at=t.admitted_at,
                               first_token_at=t.first_token_at, finished_at=t.finished_at,
                               num_tokens=len(result.token_ids), num_preemptions=result.num_preemptions)
        with self.condition:
            self.records.append(record)

    def _error(self, message: str) -> None:
        with self.condition:
            self.errors.append(message)


class _FixedContextTurns:
    """What the driver adds to a strategy, and nothing more: prompts are the fixed context's pre-tokenised ids
    (App. C.5 times no tokenisation; the context never changes, so no history enters it), and the bridge learns
    which episode submits each request."""

    engine: _RequestBridge

    def decide(self, episode):
        self.engine.local.episode = episode
        return super().decide(episode)

    def prompt_inputs(self, episode, reference_next_observation=None):
        return None                              # nothing to render: ``render`` reads the context's prompt ids

    def render(self, mode, inputs, tokenizer=None):
        return list(self.engine.local.episode.task.payload["prompt_ids"][mode])

    def run_episode(self, slot, task, reference=None, *, seed=None):
        try:
            return super().run_episode(slot, task, reference, seed=seed)
        finally:
            self.engine.episode_ended(task.payload["position"])


class _FixedContextVanilla(_FixedContextTurns, VanillaStrategy):
    pass


class _FixedContextActFirst(_FixedContextTurns, ActFirstStrategy):
    pass


def _fixed_context_strategy(strategy: str, bridge: _RequestBridge, pool: EnvPool, tokenizer: Any,
                            config: RolloutConfig) -> RolloutStrategy:
    cls = _FixedContextVanilla if strategy == "vanilla" else _FixedContextActFirst
    return cls(bridge, pool, tokenizer, config)


def set_concurrency_cap(engine: Any, b_max: int, *, timeout: float = 30.0) -> None:
    """Set ``engine.max_concurrency`` and wait until the engine reports it applied (the real engine applies
    a new cap between two steps of its loop)."""
    engine.max_concurrency = b_max
    deadline = time.monotonic() + timeout
    while engine.max_concurrency != b_max:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not apply max_concurrency={b_max} within {timeout} s")
        time.sleep(0.001)


def is_virtual_clock(engine: Any) -> bool:
    """Whether ``engine`` simulates on a virtual clock inside ``wait_idle`` (``SimulatedEngine``)."""
    from jaxopd.sampler.simulated import SimulatedEngine

    return isinstance(engine, SimulatedEngine)


def run_batch(engine: Any, strategy: str, contexts: Sequence[TaskContext], T: int, workload: Workload, *,
              b_max: int, base_seed: int = 0, tag: str = "batch", check_events: bool = False,
              timeout: float = DEFAULT_BATCH_TIMEOUT_S, tokenizer: Any = None) -> BatchRun:
    """Run one batch of ``len(contexts)`` tasks for ``T`` virtual turns under ``strategy`` with cap ``b_max``:
    the ``vanilla`` or ``actfirst`` rollout strategy plays every context's episode in a ``FixedContextEnv``.

    The engine must be idle. Raises ``RuntimeError`` if any request fails or does not produce exactly its
    fixed number of tokens, or if an episode does not play its ``T`` turns; ``TimeoutError`` if the batch does
    not finish within ``timeout`` seconds. ``check_events``: verify the engine's recorded events of this batch
    with ``check_schedule`` (the engine must record events), raising ``ScheduleViolation`` on a breach.
    ``tokenizer``: decodes responses into the trajectories (None: responses stay undecoded, as a random model
    samples embedding padding rows that no tokenizer decodes).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"the number of virtual turns T must be a positive int, got {T!r}")
    if not contexts:
        raise ValueError("a batch needs at least one task context")
    config = rollout_config(strategy, T, workload, base_seed)
    set_concurrency_cap(engine, b_max)
    first_event = len(engine.events) if check_events else 0
    virtual = is_virtual_clock(engine)
    bridge = _RequestBridge(engine, strategy=strategy, T=T, num_tasks=len(contexts), workload=workload, tag=tag,
                            virtual=virtual, timeout=timeout)
    tasks = [context_task(context, position) for position, context in enumerate(contexts)]
    runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"batch-{strategy}")
    with EnvPool(FixedContextEnv, num_slots=len(tasks)) as pool:
        rollout = _fixed_context_strategy(strategy, bridge, pool, tokenizer, config)
        wall_start = time.perf_counter()
        collected = runner.submit(rollout.collect, tasks)
        try:
            if virtual:
                bridge.release_first_turns()
                engine.wait_idle(timeout)           # the simulation runs here, releasing turns as it goes
                stranded = bridge.fail_unreleased()
                if stranded:
                    raise RuntimeError(f"{tag}: requests submitted outside the protocol's turns: {stranded[:3]}")
            trajectories = collected.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{tag}: {strategy} batch of {len(contexts)} tasks x {T} turns did not finish in "
                               f"{timeout} s") from None
        except RuntimeError:
            raise
        except Exception as exc:
            first = f"; first request error: {bridge.errors[0]}" if bridge.errors else ""
            raise RuntimeError(f"{tag}: the {strategy} rollout failed: {exc!r}{first}") from exc
        finally:
            runner.shutdown(wait=collected.done())  # a stuck rollout is left behind; closing the pool ends it
        wall_time = time.perf_counter() - wall_start
    if bridge.errors:
        raise RuntimeError(f"{tag}: {len(bridge.errors)} request(s) failed; first: {bridge.errors[0]}")
    for trajectory in trajectories:
        if trajectory.num_turns != T or trajectory.end_reason != "max_turns":
            raise RuntimeError(f"{tag}: {trajectory.task.task_id} played {trajectory.num_turns} of {T} turns "
                               f"({trajectory.end_reason})")
    per_task = 1 if strategy == "vanilla" else 2
    expected = len(contexts) * T * per_task
    if len(bridge.records) != expected:
        raise RuntimeError(f"{tag}: expected {expected} finished requests, got {len(bridge.records)}")
    records = tuple(sorted(bridge.records, key=lambda r: (r.submitted_at, r.task, r.turn, r.kind)))
    schedule = None
    if check_events:
        events = engine.events[first_event:]
        if not events:
            raise ValueError(f"{tag}: check_events needs an engine that records events (record_events=True)")
        schedule = check_schedule(events, strategy, tag=tag, T=T, num_tasks=len(contexts), b_max=b_max)
    return BatchRun(strategy=strategy, T=T, b_max=b_max, context_indices=tuple(c.index for c in contexts),
                    records=records, wall_time=wall_time, schedule=schedule,
                    num_samples=sum(len(t.responses()) for t in trajectories))


# ------------------------------------------------------------------------------------------ calibration
@dataclasses.dataclass(frozen=True)
class CalibratedLatencies:
    """Single-request latencies (submit → finish, engine alone) per context: ``measurements[kind][i]`` lists
    the measurements of context ``context_indices[i]``; kinds are ``"fast"`` and ``"full<L>"``."""

    context_indices: tuple[int, ...]
    measurements: dict[str, tuple[tuple[float, ...], ...]]

    def medians(self, kind: str) -> np.ndarray:
        if kind not in self.measurements:
            raise KeyError(f"no calibration for {kind!r}; have {sorted(self.measurements)}")
        return np.array([statistics.median(m) for m in self.measurements[kind]], dtype=np.float64)

    def median_of_medians(self, kind: str) -> float:
        return float(np.median(self.medians(kind)))

    def by_context(self, kind: str) -> dict[int, float]:
        return dict(zip(self.context_indices, self.medians(kind).tolist()))


def full_kind(full_tokens: int) -> str:
    return f"full{full_tokens}"


def calibrate_latencies(engine: Any, contexts: Sequence[TaskContext], workload: Workload, *,
                        full_token_lengths: Sequence[int], measurements: int = 3, base_seed: int = 0,
                        timeout: float = DEFAULT_BATCH_TIMEOUT_S,
                        progress: Callable[[], None] | None = None) -> CalibratedLatencies:
    """Measure each context's fast-action and full-response latencies alone on the engine, ``measurements``
    times each (App. C.5 takes the median of three), for every full length in ``full_token_lengths``.

    ``workload`` gives the fast length and the sampling settings. Requests use the seeds of the context's
    first turn; each one is submitted to an idle engine and awaited before the next.
    """
    if measurements < 1:
        raise ValueError(f"measurements must be >= 1, got {measurements}")
    if not contexts:
        raise ValueError("calibration needs at least one context")
    if not full_token_lengths:
        raise ValueError("calibration needs at least one full-response length")
    kinds = [("fast", "fast", workload)] + [(full_kind(n), "full", dataclasses.replace(workload, full_tokens=n))
                                            for n in full_token_lengths]
    values: dict[str, list[list[float]]] = {name: [[] for _ in contexts] for name, _, _ in kinds}
    set_concurrency_cap(engine, 1)
    for m in range(measurements):
        for i, context in enumerate(contexts):
            for name, kind, kind_workload in kinds:
                params = kind_workload.sampling_params(kind, request_seed(base_seed, context.index, 0, kind))
                request = Request(prompt_ids=context.prompt_ids(kind), params=params, kind=kind,
                                  request_id=f"calibrate/{name}/ctx{context.index}/m{m}")
                future = engine.submit(request)
                engine.wait_idle(timeout)
                result = future.result(timeout)
                if len(result.token_ids) != params.max_new_tokens:
                    raise RuntimeError(f"calibration request {request.request_id} produced "
                                       f"{len(result.token_ids)} tokens instead of {params.max_new_tokens}")
                values[name][i].append(result.timings.total)
                if progress is not None:
                    progress()
    return CalibratedLatencies(context_indices=tuple(c.index for c in contexts),
                               measurements={k: tuple(tuple(v) for v in per) for k, per in values.items()})


# --------------------------------------------------------------------------------------- paired repeats
@dataclasses.dataclass(frozen=True)
class PairedRepeat:
    """One paired repeat: every batch under both strategies, in ``order`` (alternated across repeats)."""

    index: int
    order: tuple[str, str]
    vanilla: tuple[BatchRun, ...]
    actfirst: tuple[BatchRun, ...]

    @property
    def vanilla_total(self) -> float:
        return sum(run.completion_time for run in self.vanilla)

    @property
    def actfirst_total(self) -> float:
        return sum(run.completion_time for run in self.actfirst)

    @property
    def speedup(self) -> float:
        """App. C.5: sum over batches of Vanilla completion times / sum of ActFirst completion times."""
        return self.vanilla_total / self.actfirst_total


@dataclasses.dataclass(frozen=True)
class PointResult:
    """All paired repeats of one scan point (full length, T, b_max)."""

    full_tokens: int
    T: int
    b_max: int
    repeats: tuple[PairedRepeat, ...]

    @property
    def speedups(self) -> list[float]:
        return [r.speedup for r in self.repeats]

    @property
    def speedup_mean(self) -> float:
        return float(np.mean(self.speedups))

    @property
    def speedup_std(self) -> float:
        """Sample standard deviation over repeats (NaN with a single repeat)."""
        return float(np.std(self.speedups, ddof=1)) if len(self.repeats) > 1 else math.nan

    @property
    def peak_concurrency(self) -> int:
        return max(run.peak_concurrency for r in self.repeats for run in r.vanilla + r.actfirst)


def strategy_order(repeat_index: int) -> tuple[str, str]:
    """Vanilla first in even repeats, ActFirst first in odd ones."""
    return ("vanilla", "actfirst") if repeat_index % 2 == 0 else ("actfirst", "vanilla")


def run_paired_point(engine: Any, batches: Sequence[Sequence[TaskContext]], *, T: int, b_max: int,
                     workload: Workload, repeats: int, base_seed: int = 0, check_events: bool = False,
                     timeout: float = DEFAULT_BATCH_TIMEOUT_S,
                     progress: Callable[[], None] | None = None) -> PointResult:
    """Paired timing of one scan point: for each repeat, each batch runs under both strategies back to back
    (same engine, contexts and seeds), the order alternating across repeats."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not batches:
        raise ValueError("a scan point needs at least one batch")
    done = []
    for k in range(repeats):
        order = strategy_order(k)
        runs: dict[str, list[BatchRun]] = {s: [] for s in STRATEGIES}
        for b, batch in enumerate(batches):
            for strategy in order:
                tag = f"L{workload.full_tokens}/T{T}/b{b_max}/rep{k}/batch{b}/{strategy}"
                runs[strategy].append(run_batch(engine, strategy, batch, T, workload, b_max=b_max,
                                                base_seed=base_seed, tag=tag, check_events=check_events,
                                                timeout=timeout))
                if check_events:
                    engine.events.clear()     # the engine is idle between batches; keeps memory flat
                if progress is not None:
                    progress()
        done.append(PairedRepeat(index=k, order=order, vanilla=tuple(runs["vanilla"]),
                                 actfirst=tuple(runs["actfirst"])))
    return PointResult(full_tokens=workload.full_tokens, T=T, b_max=b_max, repeats=tuple(done))


def make_batches(contexts: Sequence[TaskContext], tasks_per_batch: int, num_batches: int) -> list[list[TaskContext]]:
    """Consecutive groups of ``tasks_per_batch`` contexts; the first ``num_batches`` of them."""
    if tasks_per_batch < 1 or num_batches < 1:
        raise ValueError(f"tasks_per_batch and num_batches must be >= 1, got {tasks_per_batch}, {num_batches}")
    needed = tasks_per_batch * num_batches
    if len(contexts) < needed:
        raise ValueError(f"{num_batches} batches of {tasks_per_batch} tasks need {needed} contexts, "
                         f"got {len(contexts)}")
    return [list(contexts[b * tasks_per_batch:(b + 1) * tasks_per_batch]) for b in range(num_batches)]
