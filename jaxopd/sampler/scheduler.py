"""Host-side continuous-batching scheduler: queues, admission policy, page bookkeeping and preemption.

Owns each sequence's lifecycle (waiting → prefill → decode → finished, with preemption back to waiting)
and decides, step by step, which prompt chunks to prefill and which sequences to decode, under the
concurrency cap ``max_concurrency`` (b_max) and the page pool. Also owns the scheduling policies
(``SchedulingPolicy``: a map from a request's open ``kind`` tag, or its ``priority``, to an admission rank)
and a finished sequence's ``Result``. Plain Python: it never touches a device; the real engine and the
simulated one (``jaxopd.sampler.simulated``) both drive it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from concurrent.futures import Future
from typing import Any, Callable, Mapping

import numpy as np

from jaxopd.sampler.allocator import OutOfPages, PageAllocator, page_hashes
from jaxopd.sampler.types import FinishReason, Request, Result, Timings


@dataclasses.dataclass(frozen=True)
class SchedulingPolicy:
    """Which waiting request is admitted first: the lowest ``rank``, then preempted sequences (as vLLM), then
    arrival order.

    ``rank`` comes from the request's ``kind`` tag through ``kind_ranks`` (tags not listed get
    ``default_rank``), or from ``request.priority`` when ``use_priority``. New kinds of request (STI's teacher
    turns, ActionOPD's candidates) need a policy, never a change to the scheduler. Frozen and hashable.
    """

    name: str
    kind_ranks: tuple[tuple[str, int], ...] = ()
    default_rank: int = 0
    use_priority: bool = False

    @classmethod
    def by_kind(cls, name: str, ranks: Mapping[str, int], default_rank: int = 0) -> "SchedulingPolicy":
        """A policy ranking requests by their ``kind`` tag, e.g. ``by_kind("fast-first", {"fast": 0}, 1)``."""
        return cls(name, tuple(sorted(ranks.items())), default_rank)

    def rank(self, request: Request) -> int:
        if self.use_priority:
            return request.priority
        return dict(self.kind_ranks).get(request.kind, self.default_rank)

    def order_key(self, seq: "Sequence") -> tuple:
        return (self.rank(seq.request), seq.num_preemptions == 0, seq.arrival)


FIFO = SchedulingPolicy("fifo")
"""Arrival order, kinds ignored: the paper's engine."""
FAST_FIRST = SchedulingPolicy.by_kind("fast-first", {"fast": 0}, default_rank=1)
"""Fast-action requests ahead of everything else waiting (they are on the environment's critical path)."""
PRIORITY = SchedulingPolicy("priority", use_priority=True)
"""By ``request.priority`` (lower first)."""

POLICIES: dict[str, SchedulingPolicy] = {p.name: p for p in (FIFO, FAST_FIRST, PRIORITY)}
Policy = str | SchedulingPolicy


def scheduling_policy(policy: Policy) -> SchedulingPolicy:
    """A ``SchedulingPolicy`` itself, or the named one of ``POLICIES``."""
    if isinstance(policy, SchedulingPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {tuple(POLICIES)} "
                         "or pass a SchedulingPolicy")
    return POLICIES[policy]


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request in flight. ``num_cached`` tokens of ``prompt + generated`` have their KV in the cache.

    ``first_version`` / ``last_version``: weight versions of the first step that computed anything for it and
    of the step that sampled its last token. ``resolved``: its future has been given its outcome (once).
    ``detokenizer``: the engine's incremental text state, for stop strings (None when it has none).
    """

    request: Request
    future: Future
    arrival: int
    submitted_at: float
    prompt: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    state: str = "waiting"            # waiting | prefill | decode | finished
    slot: int = -1
    admit_order: int = -1
    admitted_at: float | None = None
    first_token_at: float | None = None
    num_preemptions: int = 0
    first_version: int | None = None
    last_version: int | None = None
    resolved: bool = False
    detokenizer: Any = None
    page_hashes: list[int] = dataclasses.field(default_factory=list)   # chain hashes of its full pages so far
    num_registered: int = 0           # leading pages registered in (or shared from) the prefix cache
    registrable: bool = True          # False once its KV predates a prefix-cache clear (new weights)
    score_logprobs: Any = None        # float32 [len(completion)] of a score request, filled by position

    @property
    def is_score(self) -> bool:
        """A scoring request: its ``generated`` is the given completion, prefilled, never decoded."""
        return self.request.score_ids is not None

    @property
    def output_ids(self) -> list[int]:
        """The token ids its result returns: ``generated``, except for a score request that has not been
        scored (aborted or failed before its last chunk): none, since its completion was given, not made, and
        has no log-probabilities yet (``Result.logprobs[i]`` always belongs to ``Result.token_ids[i]``)."""
        if self.is_score and len(self.logprobs) != len(self.generated):
            return []
        return self.generated

    @property
    def recompute_from(self) -> int:
        """The first token whose prefill cannot be skipped by prefix sharing: the last token (its logits
        sample the next one), or for a score request the last prompt token (its logits score the completion)."""
        return len(self.prompt) - 1 if self.is_score else self.num_tokens - 1

    def hashes_upto(self, num_pages: int, page_size: int) -> list[int]:
        """The chain hashes of its first ``num_pages`` full pages (computed once, extended as tokens grow)."""
        if num_pages > len(self.page_hashes):
            parent = self.page_hashes[-1] if self.page_hashes else None
            tokens = self.tokens[:num_pages * page_size]
            self.page_hashes += page_hashes(tokens, page_size, len(self.page_hashes), parent)
        return self.page_hashes[:num_pages]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def result(self, reason: FinishReason, finished_at: float, text: str = "", error: str | None = None) -> Result:
        """The ``Result`` of this sequence finishing now; stages it never reached take ``finished_at``."""
        admitted = self.admitted_at if self.admitted_at is not None else finished_at
        first = self.first_token_at if self.first_token_at is not None else finished_at
        versions = None
        if self.first_version is not None:
            last = self.last_version if self.last_version is not None else self.first_version
            versions = (self.first_version, last)
        return Result(request_id=self.request.request_id, kind=self.request.kind, prompt_ids=tuple(self.prompt),
                      token_ids=list(self.output_ids), text=text, logprobs=np.asarray(self.logprobs, np.float32),
                      finish_reason=reason, timings=Timings(self.submitted_at, admitted, first, finished_at),
                      num_preemptions=self.num_preemptions, error=error, policy_versions=versions,
                      seed=self.request.params.seed)


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


class Scheduler:
    """Waiting and running sequences, slots and pages; ``policy`` orders admission (a name or a policy).

    ``prefill_fits(rows, longest)``: whether a prefill batch of that many chunks, the longest that many
    tokens, may run as one step (the engine passes ``Buckets.prefill_fits``, the padded-shape budget its
    warm-up is built from); the real tokens of a batch never exceed ``max_prefill_tokens`` either.

    ``prefix_sharing``: at admission a sequence shares the cached pages of its longest full-page prefix
    (``PageAllocator``'s chain-hash prefix cache) and its prefill starts after them; at least its last token
    (a score request: its last prompt token) is always recomputed, so when the whole prompt is cached up to
    a page boundary the last page is recomputed into a private page (copy-on-write of the first page it
    writes). A sequence's full pages are registered once their keys/values are computed (swept at each
    admission, and when it finishes or is preempted). A head of the queue whose next page is being
    prefilled by a running sequence waits for it (one step for a one-chunk prompt) instead of computing it
    twice: ActFirst's fast and full requests of one context and ActionOPD's candidates arrive together.
    ``stats``: ``shared_pages`` and ``prefill_tokens_saved`` (the engine passes its own stats dict).
    """

    def __init__(self, *, max_slots: int, page_size: int, num_pages: int, policy: Policy,
                 prefill_chunk: int, max_prefill_tokens: int, max_prefill_rows: int,
                 prefill_fits: Callable[[int, int], bool] | None = None, prefix_sharing: bool = False):
        self.policy = scheduling_policy(policy)
        self.max_slots = max_slots
        self.max_concurrency = max_slots
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_rows = max_prefill_rows
        self.prefill_fits = prefill_fits or (lambda rows, longest: True)
        self.allocator = PageAllocator(num_pages)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []          # admitted: prefill or decode, in admission order
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._admit_counter = itertools.count()
        self.preempted: list[Sequence] = []        # preemptions of the last step (engine reports them)
        self.prefix_sharing = prefix_sharing
        self.stats: dict[str, int] = {"shared_pages": 0, "prefill_tokens_saved": 0}

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def admit(self, now: float) -> list[Sequence]:
        """Admit waiting sequences in policy order while a slot, the cap and the pages allow."""
        admitted = []
        self.waiting.sort(key=self.policy.order_key)
        pending: set[int] | None = None
        while self.waiting and len(self.running) < self.max_concurrency and self._free_slots:
            seq = self.waiting[0]
            # the prompt and the first decoded token (a score request decodes nothing)
            needed = self.pages_for(seq.num_tokens + (0 if seq.is_score else 1))
            shared: list[int] = []
            if self.prefix_sharing:
                if pending is None:
                    pending = self._register_running()
                hashes = seq.hashes_upto(seq.recompute_from // self.page_size, self.page_size)
                shared = self.allocator.cached_prefix(hashes)
                if len(shared) < len(hashes) and hashes[len(shared)] in pending:
                    break                                  # a running prefill is computing its next page
                self.allocator.share(shared)
            if needed - len(shared) > self.allocator.num_free:
                self.allocator.release(shared)
                break                                      # wait for pages; never skip ahead of the head
            self.waiting.pop(0)
            seq.pages = shared + self.allocator.allocate(needed - len(shared))
            seq.slot = self._free_slots.pop()
            seq.state = "prefill"
            seq.num_cached = len(shared) * self.page_size
            seq.num_registered = len(shared)
            seq.registrable = True
            self.stats["shared_pages"] += len(shared)
            self.stats["prefill_tokens_saved"] += len(shared) * self.page_size
            if self.prefix_sharing:
                pending.update(seq.hashes_upto(seq.num_tokens // self.page_size, self.page_size)[len(shared):])
            seq.admit_order = next(self._admit_counter)
            if seq.admitted_at is None:
                seq.admitted_at = now
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    # ------------------------------------------------------------------ prefix cache
    def register_full_pages(self, seq: Sequence) -> None:
        """Register ``seq``'s pages whose keys/values are all computed in the prefix cache."""
        if not (self.prefix_sharing and seq.registrable):
            return
        full = min(seq.num_cached // self.page_size, len(seq.pages))
        if full > seq.num_registered:
            hashes = seq.hashes_upto(full, self.page_size)
            for i in range(seq.num_registered, full):
                self.allocator.register(seq.pages[i], hashes[i])
            seq.num_registered = full

    def _register_running(self) -> set[int]:
        """Register the computed full pages of every running sequence; return the hashes of the full
        prompt pages that running prefills are still computing."""
        pending: set[int] = set()
        for seq in self.running:
            self.register_full_pages(seq)
            if seq.state == "prefill" and seq.registrable:
                hashes = seq.hashes_upto(seq.num_tokens // self.page_size, self.page_size)
                pending.update(hashes[seq.num_cached // self.page_size:])
        return pending

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (new weights, or a re-created KV cache): nothing computed so far is
        shared with a sequence admitted later, and running sequences never register their pages again."""
        self.allocator.clear_prefix_cache()
        for seq in self.running:
            seq.registrable = False

    def prefill_chunks(self) -> list[PrefillChunk]:
        """Chunks of prompts still to prefill, oldest admission first, within the row and token budgets and
        ``prefill_fits`` (the first chunk always runs, so prefill never stalls)."""
        chunks: list[PrefillChunk] = []
        budget, longest = self.max_prefill_tokens, 0
        for seq in self.running:
            if seq.state != "prefill":
                continue
            if len(chunks) >= self.max_prefill_rows:
                break
            length = min(self.prefill_chunk, seq.num_tokens - seq.num_cached, budget)
            if length <= 0:
                break
            if chunks and not self.prefill_fits(len(chunks) + 1, max(longest, length)):
                break
            chunks.append(PrefillChunk(seq, seq.num_cached, length))
            budget -= length
            longest = max(longest, length)
        return chunks

    def decode_sequences(self) -> list[Sequence]:
        """Sequences to decode this step, each with a page for its next position (preempting if needed)."""
        self.preempted = []
        for seq in list(self.running):
            if seq.state != "decode" or seq not in self.running:
                continue
            while self.pages_for(seq.num_cached + 1) > len(seq.pages):
                try:
                    seq.pages += self.allocator.allocate(1)
                except OutOfPages:
                    victim = self._choose_victim()
                    self.preempt(victim)
                    if victim is seq:
                        break
        return [s for s in self.running if s.state == "decode"]

    def _choose_victim(self) -> Sequence:
        """The lowest-priority (largest priority value), most recently admitted running sequence."""
        return max(self.running, key=lambda s: (s.request.priority, s.admit_order))

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages and requeue it; its KV is recomputed (prompt + generated) on re-admission."""
        self.running.remove(seq)
        self.register_full_pages(seq)
        self.allocator.release(seq.pages)
        seq.pages = []
        self._free_slots.append(seq.slot)
        seq.slot = -1
        seq.state = "waiting"
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.waiting.append(seq)
        self.preempted.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's pages and slot."""
        if seq in self.running:
            self.running.remove(seq)
            self.register_full_pages(seq)
            self.allocator.release(seq.pages)
            self._free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.pages = []
        seq.slot = -1
        seq.state = "finished"
