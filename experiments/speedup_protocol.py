"""The paired Vanilla / ActFirst virtual-turn protocol of the rollout-speedup experiment (paper App. C.5).

Owns the drivers that run one batch of tasks for T virtual turns on fixed contexts through an engine
(``run_batch``), the single-request latency calibration (``calibrate_latencies``) and paired, order-alternated
repeats over batches (``run_paired_point``). It works with any ``jaxopd.sampler.EngineProtocol`` (it uses
``submit`` → future, ``max_concurrency``, ``wait_idle``, ``events``): ``jaxopd.sampler.Engine`` or
``jaxopd.sampler.SimulatedEngine``. Times come from the engine's own ``Result.timings``, so they cover
queueing, prefill, decoding and scheduling and exclude tokenisation (prompts arrive as token ids).

Scheduling of one batch of N tasks, each with its own fixed context, for T virtual turns:

* **Vanilla** (think-then-act): each task submits its full response of turn 1; when the full response of
  turn t finishes, the task submits turn t+1. A task never has two requests in flight.
* **ActFirst**: at each turn a task submits its fast action and its full response together; the fast
  action's completion releases the next turn, while full responses of earlier turns keep running.

A batch ends when all its requests have finished; its completion time runs from its first submission to its
last finish. Next-turn submissions happen inside the engine's future callbacks, i.e. as soon as the gating
request finishes.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from jaxopd.sampler import Request, SamplingParams

Strategy = Literal["vanilla", "actfirst"]
STRATEGIES: tuple[str, ...] = ("vanilla", "actfirst")
KINDS: tuple[str, ...] = ("fast", "full")
DEFAULT_BATCH_TIMEOUT_S = 3 * 3600.0


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


def request_seed(base_seed: int, context_index: int, turn: int, kind: str) -> int:
    """The sampling seed of one request: a function of the context, the turn and the kind only, so both
    strategies and every repeat sample their full responses with the same seeds."""
    entropy = [int(base_seed), int(context_index), int(turn), KINDS.index(kind)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])


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
    for key, record in sorted(life.items(), key=lambda kv: kv[1]["submit"][1]):
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
class _BatchDriver:
    """Submits the requests of one batch and reacts to their completions (on the engine's thread)."""

    def __init__(self, engine: Any, strategy: str, contexts: Sequence[TaskContext], T: int, workload: Workload,
                 base_seed: int, tag: str):
        self.engine = engine
        self.strategy = strategy
        self.contexts = contexts
        self.T = T
        self.workload = workload
        self.base_seed = base_seed
        self.tag = tag
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.outstanding = 0
        self.records: list[RequestRecord] = []
        self.errors: list[str] = []

    def start(self) -> None:
        for task in range(len(self.contexts)):
            self._submit_turn(task, 0)

    def _submit_turn(self, task: int, turn: int) -> None:
        kinds = ("full",) if self.strategy == "vanilla" else ("fast", "full")
        for kind in kinds:                      # fast first: "submitted together", the fast one queued first
            self._submit(task, turn, kind)

    def _submit(self, task: int, turn: int, kind: str) -> None:
        context = self.contexts[task]
        seed = request_seed(self.base_seed, context.index, turn, kind)
        request = Request(prompt_ids=context.prompt_ids(kind), params=self.workload.sampling_params(kind, seed),
                          kind=kind, request_id=f"{self.tag}/task{task}/turn{turn}/{kind}")
        with self.lock:
            self.outstanding += 1
        try:
            future = self.engine.submit(request)
        except Exception as exc:  # noqa: BLE001 - reported after the batch drains
            self._finish_one(error=f"submit of {request.request_id} failed: {exc!r}")
            return
        future.add_done_callback(lambda f: self._on_done(f, task, turn, kind, request.request_id))

    def _on_done(self, future, task: int, turn: int, kind: str, request_id: str) -> None:
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001
            self._finish_one(error=f"{request_id} failed: {exc!r}")
            return
        expected = self.workload.tokens(kind)
        if result.finish_reason not in ("length", "stop") or len(result.token_ids) != expected:
            self._finish_one(error=f"{request_id} ended with {result.finish_reason!r} after "
                                   f"{len(result.token_ids)} tokens; the protocol fixes {expected}")
            return
        t = result.timings
        record = RequestRecord(request_id=request_id, task=task, turn=turn, kind=kind,
                               submitted_at=t.submitted_at, admitted_at=t.admitted_at,
                               first_token_at=t.first_token_at, finished_at=t.finished_at,
                               num_tokens=len(result.token_ids), num_preemptions=result.num_preemptions)
        with self.lock:
            self.records.append(record)
            failed = bool(self.errors)
        gates_next_turn = (kind == "full") if self.strategy == "vanilla" else (kind == "fast")
        if gates_next_turn and turn + 1 < self.T and not failed:
            self._submit_turn(task, turn + 1)    # before this request is counted done: the batch cannot end here
        self._finish_one()

    def _finish_one(self, error: str | None = None) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(error)
            self.outstanding -= 1
            if self.outstanding == 0:
                self.done.set()


def set_concurrency_cap(engine: Any, b_max: int, *, timeout: float = 30.0) -> None:
    """Set ``engine.max_concurrency`` and wait until the engine reports it applied (the real engine applies
    a new cap between two steps of its loop)."""
    engine.max_concurrency = b_max
    deadline = time.monotonic() + timeout
    while engine.max_concurrency != b_max:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not apply max_concurrency={b_max} within {timeout} s")
        time.sleep(0.001)


def run_batch(engine: Any, strategy: str, contexts: Sequence[TaskContext], T: int, workload: Workload, *,
              b_max: int, base_seed: int = 0, tag: str = "batch", check_events: bool = False,
              timeout: float = DEFAULT_BATCH_TIMEOUT_S) -> BatchRun:
    """Run one batch of ``len(contexts)`` tasks for ``T`` virtual turns under ``strategy`` with cap ``b_max``.

    The engine must be idle. Raises ``RuntimeError`` if any request fails or does not produce exactly its
    fixed number of tokens, ``TimeoutError`` if the batch does not finish within ``timeout`` seconds.
    ``check_events``: verify the engine's recorded events of this batch with ``check_schedule`` (the engine
    must record events), raising ``ScheduleViolation`` on a breach.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"the number of virtual turns T must be a positive int, got {T!r}")
    if not contexts:
        raise ValueError("a batch needs at least one task context")
    set_concurrency_cap(engine, b_max)
    first_event = len(engine.events) if check_events else 0
    driver = _BatchDriver(engine, strategy, contexts, T, workload, base_seed, tag)
    wall_start = time.perf_counter()
    driver.start()
    engine.wait_idle(timeout)         # the fake engine simulates here; the real one just blocks
    if not driver.done.wait(timeout):
        raise TimeoutError(f"{tag}: {strategy} batch of {len(contexts)} tasks x {T} turns did not finish in "
                           f"{timeout} s ({driver.outstanding} requests outstanding)")
    wall_time = time.perf_counter() - wall_start
    if driver.errors:
        raise RuntimeError(f"{tag}: {len(driver.errors)} request(s) failed; first: {driver.errors[0]}")
    per_task = 1 if strategy == "vanilla" else 2
    expected = len(contexts) * T * per_task
    if len(driver.records) != expected:
        raise RuntimeError(f"{tag}: expected {expected} finished requests, got {len(driver.records)}")
    records = tuple(sorted(driver.records, key=lambda r: (r.submitted_at, r.task, r.turn, r.kind)))
    schedule = None
    if check_events:
        events = engine.events[first_event:]
        if not events:
            raise ValueError(f"{tag}: check_events needs an engine that records events (record_events=True)")
        schedule = check_schedule(events, strategy, tag=tag, T=T, num_tasks=len(contexts), b_max=b_max)
    return BatchRun(strategy=strategy, T=T, b_max=b_max, context_indices=tuple(c.index for c in contexts),
                    records=records, wall_time=wall_time, schedule=schedule)


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
