"""Engine fuzz: thousands of seeded requests, valid and invalid, under aborts, cap changes and page pressure.

Load: ``requests`` requests from a seeded generator mixing valid and invalid fields (types, ranges, lengths,
stop strings, odd unicode). Valid ones vary prompt lengths (up to exactly ``max_seq_len``), output lengths,
``min_new_tokens``, greedy and sampled decoding, top-p/top-k, seeds, stop tokens (drawn from tokens the model
is seen to emit, so stops do happen), stop strings (common letters and odd unicode: emoji, combining marks,
CJK, RTL, zero-width, NUL), kinds, priorities, shared prompt prefixes and score requests. Each invalid one
breaks exactly one field, and the driver knows which.

Disruptions, from a second thread while requests are in flight: ``abort`` of random in-flight requests (and
of unknown ids), cancelled futures, valid ``max_concurrency`` changes (1..max_slots) and invalid ones (which
must raise ``ValueError`` naming ``max_concurrency``). The engine's page pool is small enough that
preemption happens (counted from ``Engine.stats['preemptions']`` and the ``preempt`` events).

Expected, and checked: every invalid request raises ``ValueError`` at ``submit`` whose message names its
field; every valid one completes with exactly ``max_new_tokens`` tokens (``length``) or stops at the first
stop token / stop-string completion counted from ``min_new_tokens`` (``stop``), its text being
``decode(token_ids)``, its log-probs finite; a score request returns its completion with finite log-probs;
``abort`` only for requests the fuzzer aborted or cancelled; no future hangs (every wait has a timeout);
every page returns to the pool; nothing compiles after warm-up.

Pages: ``PageAllocator.num_free`` counts fresh free pages plus prefix-cached pages nobody holds (kept with
their hash for reuse, evicted by ``allocate`` on demand), so "every page returned" means ``num_free ==
num_pages - 1`` (page 0 is the null page) and every reference count is 0; the pages still cached (evictable)
are reported separately.

    python -m bench.fuzz_engine --requests 2000 --seed 0 --out results/reliability
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import re
import sys
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from bench.common import write_result  # noqa: E402
from jaxopd.sampler.types import Request, SamplingParams  # noqa: E402

REPLACEMENT_CHARACTER = "\ufffd"

COMMON_STOPS = ("e", "a", " ", "s", "in", "the", ".", "\n", "<", "|")
"""Stop strings a random model's text completes often, so ``stop`` results happen."""
ODD_STOPS = ("😀", "e\u0301", "é", "中文", "的", "日本語", "שלום", "مرحبا", "\u200b", "\u200d", "\u202e", "\x00",
             "\ufeff", "🏳️‍🌈", "👍🏽", "ǅ", "ﬁ", "Ω", "a\x00b", "\r\n", "\t", "\U0010ffff", "\ud800", "<|im_end|>")
"""Odd unicode stop strings (all valid: non-empty ``str``), incl. a lone surrogate and a noncharacter."""
ODD_TEXTS = ("héllo wörld", "😀🏳️‍🌈👍🏽", "中文的日本語", "שלום مرحبا", "zero\u200bwidth\u200djoin", "nul\x00byte",
             "e\u0301\u0301\u0301", "\ufeffbom", "ǅﬁΩ", "<|im_start|>user\nhi<|im_end|>", "\r\n\t ", "right\u202eleft")
KINDS = ("fast", "full", "teacher", "candidate", "ünïcødé", "🚀", "k" * 300)

FIELDS = ("prompt_ids", "params", "kind", "priority", "request_id", "score_ids", "max_new_tokens",
          "min_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop_strings", "seed")


# ------------------------------------------------------------------------------------------------ report
@dataclasses.dataclass
class FuzzReport:
    """The figures of one fuzz run. Every fuzzed request lands in exactly one outcome: ``rejected`` (an
    invalid request refused with a ``ValueError`` naming its field), ``completed`` (a valid request whose
    result passed every check, including requests whose abort landed after they finished), ``aborted``
    (aborted or cancelled by the fuzzer and resolved as such), or one of the failures ``rejected_unnamed``
    (a ``ValueError`` not naming the field), ``accepted_invalid``, ``rejected_valid``, ``submit_crashes`` (any
    other exception at ``submit``), ``errors`` (``finish_reason='error'`` or an exception), ``wrong`` (a result
    breaking the contract) and ``lost`` (not resolved within the timeout)."""

    requests: int = 0                 # fuzzed: submit attempted
    valid: int = 0
    invalid: int = 0
    rejected: int = 0
    completed: int = 0
    aborted: int = 0
    lost: int = 0
    errors: int = 0
    wrong: int = 0
    rejected_unnamed: int = 0
    accepted_invalid: int = 0
    rejected_valid: int = 0
    submit_crashes: int = 0
    stalled: bool = False             # submission stopped: no request resolved within the stall timeout
    idle: bool = True                 # wait_idle returned True at the end
    score_requests: int = 0
    finish_reasons: dict = dataclasses.field(default_factory=dict)
    stops_by_token: int = 0
    stops_by_string: int = 0
    completed_after_preemption: int = 0
    aborts_sent: int = 0
    unknown_aborts_sent: int = 0
    cancels_sent: int = 0
    concurrency_changes: int = 0
    concurrency_rejected: int = 0     # invalid caps refused with a ValueError naming max_concurrency
    concurrency_failures: int = 0     # invalid caps accepted, or refused without naming the field
    preemptions: int = 0              # Engine.stats['preemptions'] during the run
    preempt_events: int = 0           # 'preempt' events (0 unless EngineConfig.record_events)
    pages_total: int = 0              # allocatable pages (num_pages - 1: page 0 is the null page)
    pages_free_start: int = 0         # free or evictable (cached, unheld) pages before the run
    pages_free_end: int = 0           # ... after wait_idle
    pages_held_end: int = 0           # pages with a reference count > 0 after wait_idle (must be 0)
    pages_cached_end: int = 0         # prefix-cache pages still registered (free, evictable)
    slots_free_end: int = 0
    compiled_after_warmup: int = 0
    compiled_end: int = 0
    rejections_by_field: dict = dataclasses.field(default_factory=dict)
    failures: list = dataclasses.field(default_factory=list)   # the first messages of every failure
    wall_s: float = 0.0

    def problems(self) -> list[str]:
        """What breaks the expectations (empty when the run passed)."""
        out = []
        for name in ("lost", "errors", "wrong", "rejected_unnamed", "accepted_invalid", "rejected_valid",
                     "submit_crashes", "concurrency_failures", "pages_held_end"):
            if getattr(self, name):
                out.append(f"{name} = {getattr(self, name)}")
        if self.stalled:
            out.append("submission stalled (no request resolved within the stall timeout)")
        if not self.idle:
            out.append("wait_idle timed out")
        if self.pages_free_end != self.pages_total:
            out.append(f"pages: {self.pages_free_end} of {self.pages_total} free at the end")
        if self.compiled_end != self.compiled_after_warmup:
            out.append(f"recompiled after warm-up: {self.compiled_after_warmup} -> {self.compiled_end}")
        accounted = (self.rejected + self.completed + self.aborted + self.lost + self.errors + self.wrong
                     + self.rejected_unnamed + self.accepted_invalid + self.rejected_valid + self.submit_crashes)
        if accounted != self.requests:
            out.append(f"accounting: {accounted} outcomes for {self.requests} requests")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok, "problems": self.problems()}


# ------------------------------------------------------------------------------------------------ cases
@dataclasses.dataclass
class FuzzCase:
    """One generated request: ``fields`` are ``Request`` arguments (``params`` a dict of ``SamplingParams``
    arguments); ``broken`` names the one invalid field (None for a valid request)."""

    index: int
    fields: dict
    broken: str | None = None
    how: str = ""

    def request(self) -> Request:
        fields = dict(self.fields)
        params = fields.pop("params")
        if self.broken != "params":
            params = SamplingParams(**params)
        score_ids = fields.pop("score_ids", None)
        return Request(params=params, score_ids=score_ids, **fields)


@dataclasses.dataclass
class _Context:
    vocab_size: int
    max_seq_len: int
    max_slots: int
    eos_token_ids: tuple[int, ...]
    likely_tokens: list[int]
    odd_prompts: list[list[int]]
    prefixes: list[list[int]]


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _as_sequence(rng: random.Random, ids: list[int]) -> Any:
    """The same token ids as a list, tuple or 1-D numpy array (all valid)."""
    form = rng.random()
    if form < 0.6:
        return ids
    if form < 0.8:
        return tuple(ids)
    return np.asarray(ids, dtype=rng.choice((np.int32, np.int64, np.uint32)))


def _valid_fields(rng: random.Random, ctx: _Context, index: int, seed: int) -> dict:
    V, L = ctx.vocab_size, ctx.max_seq_len
    r = rng.random()
    max_new = rng.randint(1, 6) if r < 0.72 else rng.randint(7, 24) if r < 0.92 else rng.randint(25, L // 2)
    room = L - max_new
    shape = rng.random()
    if shape < 0.4:
        prompt = _ids(rng, rng.randint(1, min(16, room)), V)
    elif shape < 0.6:
        prompt = _ids(rng, rng.randint(1, min(64, room)), V)
    elif shape < 0.75:                                      # a shared prefix (prefix sharing, duplicates)
        prefix = rng.choice(ctx.prefixes)[:room]
        prompt = prefix + _ids(rng, rng.randint(0, min(8, room - len(prefix))), V)
    elif shape < 0.85:                                      # long: at or near max_seq_len
        prompt = _ids(rng, room - (0 if rng.random() < 0.5 else rng.randint(0, min(8, room - 1))), V)
    else:                                                   # odd unicode text, tokenized
        prompt = rng.choice(ctx.odd_prompts)[:room]
    params: dict = {"max_new_tokens": max_new if rng.random() < 0.9 else np.int64(max_new)}
    m = rng.random()
    if m < 0.2:
        params["min_new_tokens"] = max_new
    elif m < 0.5:
        params["min_new_tokens"] = rng.randint(0, max_new)
    t = rng.random()
    params["temperature"] = (0.0 if t < 0.3 else rng.choice((0.6, 1.0, 1.3, 1e-4, 1e-30, 1e-40, 5e-324, 1e30, 50.0,
                                                               np.float32(0.7), 1)))
    if rng.random() < 0.06:       # rare: one truncating row makes the whole batch's step ~9x slower on CPU
        params["top_p"] = rng.choice((0.9, 0.5, 1e-6, 1.0, np.float64(0.95)))
    if rng.random() < 0.04:
        params["top_k"] = rng.choice((1, 5, 50, V, np.int32(3)))
    s = rng.random()
    if s < 0.4:
        params["seed"] = rng.choice((0, 2 ** 32 - 1, rng.randrange(2 ** 32), np.uint32(7), np.int64(12345)))
    if rng.random() < 0.3:
        stops = rng.sample(ctx.likely_tokens, min(len(ctx.likely_tokens), rng.randint(1, 8)))
        stops += _ids(rng, rng.randint(0, 3), V) + list(ctx.eos_token_ids[:rng.randint(0, 1)])
        params["stop_token_ids"] = _as_sequence(rng, stops)
    if rng.random() < 0.35:
        pool = COMMON_STOPS if rng.random() < 0.5 else ODD_STOPS
        stops = rng.sample(pool, rng.randint(1, 3)) + rng.sample(ODD_STOPS, rng.randint(0, 2))
        params["stop_strings"] = stops if rng.random() < 0.7 else tuple(stops)
    fields = {"prompt_ids": _as_sequence(rng, prompt), "params": params, "request_id": f"fuzz-{seed}-{index}",
              "kind": rng.choice(KINDS)}
    if rng.random() < 0.5:
        fields["priority"] = rng.choice((0, 1, -3, 7, np.int64(2), 10 ** 12))
    if rng.random() < 0.08:                                 # a score request
        completion = _ids(rng, rng.randint(1, min(32, L - 1)), V)
        prompt_len = rng.randint(1, min(64, L - len(completion)))
        if rng.random() < 0.3:
            prompt_len = L - len(completion)              # prompt + completion == max_seq_len exactly
        fields["prompt_ids"] = _as_sequence(rng, _ids(rng, prompt_len, V))
        fields["score_ids"] = _as_sequence(rng, completion)
        fields["params"] = {"max_new_tokens": 1, "temperature": rng.choice((0.0, 0.6, 1.0, 1.3))}
        fields["kind"] = "score"
    return fields


def _bad_int(rng: random.Random) -> Any:
    return rng.choice((1.5, "3", True, False, None, [3], np.float32(2.0), float("nan"), np.array([3, 4]), b"3",
                       3 + 0j, np.bool_(True)))


def _mutations(ctx: _Context) -> list[tuple[str, Callable[[random.Random, dict], str]]]:
    """(field, mutate) pairs: ``mutate(rng, fields)`` breaks that one field in place and says how."""
    V, L = ctx.vocab_size, ctx.max_seq_len

    def param(name, values):
        def mutate(rng, f):
            value = values(rng, f) if callable(values) else rng.choice(values)
            f["params"][name] = value
            return f"{name}={_short(value)}"
        return name, mutate

    def field(name, values):
        def mutate(rng, f):
            value = values(rng, f) if callable(values) else rng.choice(values)
            f[name] = value
            return f"{name}={_short(value)}"
        return name, mutate

    def max_new_too_long(rng, f):
        return L - len(f["prompt_ids"]) + rng.randint(1, 10 ** 6)

    def prompt_too_long(rng, f):
        return _ids(rng, L - int(f["params"]["max_new_tokens"]) + rng.randint(1, 40), V)

    def bad_prompt(rng, f):
        good = list(f["prompt_ids"])[:8]
        return rng.choice(([], "abc", None, 5, np.zeros((2, 3), np.int64), np.array(5), good + [-1], good + [V],
                           good + [2 ** 70], good + [1.5], good + [True], good + [None], [good], set(good),
                           iter(good), {0: 1}, np.asarray(good, np.float64), b"\x01\x02", "", good + [np.nan]))

    def min_over_max(rng, f):
        return int(f["params"]["max_new_tokens"]) + rng.randint(1, 5)

    def bad_score(rng, f):
        f["params"] = {"max_new_tokens": 1, "temperature": 1.0}
        f["kind"] = "score"
        n = len(f["prompt_ids"])
        return rng.choice(([], "ab", [V], [-1], [1.5], [None], np.zeros((2, 2), np.int64), [True], 7,
                           _ids(rng, L - n + rng.randint(1, 10), V)))

    return [
        field("prompt_ids", bad_prompt),
        field("prompt_ids", prompt_too_long),
        field("params", (None, {"max_new_tokens": 4}, "params", 4, (4,))),
        field("kind", ("", None, 5, ["fast"], b"fast", 0.5)),
        field("priority", (1.5, "1", None, True, np.float64(1), [1], float("inf"))),
        field("request_id", (12345, b"id", ["x"], 1.5, ("a",), True)),
        field("score_ids", bad_score),
        param("max_new_tokens", lambda rng, f: rng.choice((0, -1, -2 ** 63, _bad_int(rng), _bad_int(rng)))),
        param("max_new_tokens", max_new_too_long),
        param("min_new_tokens", lambda rng, f: rng.choice((-1, -10 ** 9, _bad_int(rng)))),
        param("min_new_tokens", min_over_max),
        param("temperature", (-1e-9, -1.0, float("-inf"), float("inf"), float("nan"), 10 ** 400, -(10 ** 400),
                              np.float32("nan"), "0.5", None, True, 1 + 0j, [0.7], np.array([0.5, 0.7]))),
        param("top_p", (0, 0.0, -0.1, 1.0000001, float("nan"), float("inf"), 10 ** 400, "1", None, True,
                        np.float32(0.0), [0.9])),
        param("top_k", (-1, V + 1, 2 ** 31, 10 ** 400, 1.0, True, None, "5", np.float64(3), [5])),
        param("stop_token_ids", lambda rng, f: rng.choice((5, "ab", None, [V], [-1], [1.5], [True], [None],
                                                          np.zeros((2, 2), np.int64), [2 ** 64], [1, 2, V + 7],
                                                          np.array(3), b"ab", {1, 2}, [[1]]))),
        param("stop_strings", ("abc", "e", "😀", [""], ["ok", ""], [5], [None], [b"x"], 5, None, np.zeros((1, 1)),
                               {"a"}, [["a"]], b"stop", [("a",)])),
        param("seed", (-1, 2 ** 32, 2 ** 64, -(2 ** 70), 1.5, "7", True, float("nan"), np.float64(3), [1],
                       np.int64(-5))),
    ]


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def generate_cases(n: int, seed: int, ctx: _Context, invalid_fraction: float = 0.3) -> list[FuzzCase]:
    """``n`` cases from ``seed``: about ``invalid_fraction`` of them break exactly one field."""
    rng = random.Random(seed)
    mutations = _mutations(ctx)
    cases = []
    for i in range(n):
        fields = _valid_fields(rng, ctx, i, seed)
        case = FuzzCase(i, fields)
        if rng.random() < invalid_fraction:
            fields["params"] = dict(fields["params"])
            name, mutate = rng.choice(mutations)
            if name != "score_ids" and fields.get("score_ids") is not None:
                del fields["score_ids"]                     # break one field of a generation request
            case.broken, case.how = name, mutate(rng, fields)
        cases.append(case)
    return cases


def names_field(message: str, field: str) -> bool:
    """Whether ``message`` names ``field`` as a word (``top_p`` is not named by ``top_pp``)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", message) is not None


# ------------------------------------------------------------------------------------------------ checks
def first_stop(token_ids: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int],
               tokenizer: Any) -> tuple[int | None, str]:
    """(number of tokens at the first stop, 'token' | 'string'), or (None, '') when nothing stops: a token
    counts from ``min_new_tokens`` on if it is a stop token, or if the text it adds completes a stop string.
    The text grows like the engine's incremental text: not while the decoded text ends in an incomplete
    character (U+FFFD), but here from whole decodes of each prefix, not the engine's own code."""
    stops = set(params.stop_token_ids) | set(eos_token_ids)
    text = ""
    for k in range(1, len(token_ids) + 1):
        new_from = len(text)
        if params.stop_strings:
            full = tokenizer.decode(token_ids[:k])
            if len(full) > len(text) and not full.endswith(REPLACEMENT_CHARACTER):
                text = full
        if k < params.min_new_tokens:
            continue
        if token_ids[k - 1] in stops:
            return k, "token"
        if new_from < len(text) and any(s in text[max(0, new_from - len(s) + 1):] for s in params.stop_strings):
            return k, "string"
    return None, ""


def check_result(request: Request, result: Any, *, tokenizer: Any, eos_token_ids: Sequence[int],
                 vocab_size: int) -> tuple[str | None, str]:
    """(problem or None, how it finished: 'length' | 'token' | 'string' | 'abort' | 'score') for a result of
    the served form of ``request`` (normalised params); ``abort`` results are checked only for their shape."""
    params = request.params
    tokens = list(result.token_ids)
    logprobs = np.asarray(result.logprobs)
    if result.request_id != request.request_id:
        return f"request_id {result.request_id!r}", ""
    if result.finish_reason == "error":
        return f"error: {result.error}", ""
    if tuple(result.prompt_ids) != tuple(int(t) for t in request.prompt_ids):
        return "prompt_ids differ", ""
    if logprobs.shape != (len(tokens),):
        return f"{logprobs.shape} log-probs for {len(tokens)} tokens", ""
    if not np.all(np.isfinite(logprobs)) or np.any(logprobs > 1e-3):
        return f"log-probs not finite or > 0: {logprobs[~np.isfinite(logprobs) | (logprobs > 1e-3)][:4]}", ""
    if any(not 0 <= t < vocab_size for t in tokens):
        return "token ids out of the vocabulary", ""
    if tokenizer is not None and result.text != tokenizer.decode(tokens):
        return "text != decode(token_ids)", ""
    if request.score_ids is not None:
        if result.finish_reason not in ("length", "abort"):
            return f"score request finished with {result.finish_reason!r}", ""
        if result.finish_reason == "length":
            if tokens != [int(t) for t in request.score_ids]:
                return "score request: token_ids != score_ids", ""
            return None, "score"
        return None, "abort"
    if params.seed is not None and result.seed != int(params.seed):
        return f"seed {result.seed} for requested {params.seed}", ""
    if len(tokens) > params.max_new_tokens:
        return f"{len(tokens)} tokens > max_new_tokens {params.max_new_tokens}", ""
    if result.finish_reason == "abort":
        return None, "abort"
    at, how = first_stop(tokens, params, eos_token_ids, tokenizer)
    if result.finish_reason == "length":
        if len(tokens) != params.max_new_tokens:
            return f"length: {len(tokens)} tokens, max_new_tokens {params.max_new_tokens}", ""
        if at is not None and at < len(tokens):
            return f"length, but a stop ({how}) at token {at} of {len(tokens)}", ""
        if at == len(tokens):
            return f"length, but the last token stops ({how})", ""
        return None, "length"
    if result.finish_reason == "stop":
        if at != len(tokens):
            return f"stop after {len(tokens)} tokens, first stop at {at} (min_new_tokens {params.min_new_tokens})", ""
        return None, how
    return f"finish_reason {result.finish_reason!r}", ""


# ------------------------------------------------------------------------------------------------ the driver
class _Fuzzer:
    def __init__(self, engine, tokenizer, report: FuzzReport, *, seed: int, window: int, abort_fraction: float,
                 cancel_fraction: float, tick: float, max_failures: int):
        self.engine, self.tokenizer, self.report = engine, tokenizer, report
        self.seed, self.window, self.tick = seed, window, tick
        self.abort_fraction, self.cancel_fraction = abort_fraction, cancel_fraction
        self.max_failures = max_failures
        self.lock = threading.Lock()
        self.in_flight: dict[str, Future] = {}
        self.slots = threading.BoundedSemaphore(window)
        self.aborted_ids: set[str] = set()
        self.cancelled_ids: set[str] = set()
        self.submitted = 0
        self.stop = threading.Event()
        self.disruptor_error: BaseException | None = None

    def fail(self, message: str) -> None:
        with self.lock:
            if len(self.report.failures) < self.max_failures:
                self.report.failures.append(message)

    # -------------------------------------------------------------------- the disruption thread
    def disrupt(self) -> None:
        try:
            self._disrupt()
        except BaseException as exc:  # noqa: BLE001 - reported as a failure of the run
            self.disruptor_error = exc
            self.fail(f"disruptor crashed: {type(exc).__name__}: {exc}")

    def _disrupt(self) -> None:
        rng = random.Random(self.seed ^ 0x5EED)
        engine, report = self.engine, self.report
        max_slots = engine.max_slots
        while not self.stop.wait(rng.uniform(0.0, 2 * self.tick)):
            x = rng.random()
            with self.lock:
                ids = list(self.in_flight)
                submitted = self.submitted
            if x < 0.45:
                if ids and report.aborts_sent < self.abort_fraction * submitted:
                    rid = rng.choice(ids)
                    with self.lock:
                        self.aborted_ids.add(rid)
                    engine.abort(rid)
                    report.aborts_sent += 1
            elif x < 0.52:
                if ids and report.cancels_sent < self.cancel_fraction * submitted:
                    rid = rng.choice(ids)
                    with self.lock:
                        future = self.in_flight.get(rid)
                        self.cancelled_ids.add(rid)
                    if future is not None:
                        future.cancel()
                        report.cancels_sent += 1
            elif x < 0.57:
                engine.abort(rng.choice(("no-such-request", "", None, 5, "fuzz-never-submitted")))
                report.unknown_aborts_sent += 1
            elif x < 0.92:
                k = rng.randint(1, max_slots)
                engine.max_concurrency = k if rng.random() < 0.8 else np.int64(k)
                report.concurrency_changes += 1
            else:
                bad = rng.choice((0, -1, max_slots + 1, 2.5, True, "3", None, float("nan"), [2]))
                try:
                    engine.max_concurrency = bad
                except ValueError as exc:
                    if names_field(str(exc), "max_concurrency"):
                        report.concurrency_rejected += 1
                    else:
                        report.concurrency_failures += 1
                        self.fail(f"max_concurrency={bad!r}: ValueError without the field: {exc}")
                except Exception as exc:  # noqa: BLE001
                    report.concurrency_failures += 1
                    self.fail(f"max_concurrency={bad!r}: {type(exc).__name__}: {exc}")
                else:
                    report.concurrency_failures += 1
                    self.fail(f"max_concurrency={bad!r} accepted")

    # -------------------------------------------------------------------- submission
    def _released(self, rid: str):
        def callback(_future: Future) -> None:
            with self.lock:
                self.in_flight.pop(rid, None)
            self.slots.release()
        return callback

    def submit_all(self, cases: list[FuzzCase], stall_timeout: float) -> list[tuple[FuzzCase, Request, Future]]:
        report, engine = self.report, self.engine
        live = []
        for case in cases:
            if not self.slots.acquire(timeout=stall_timeout):
                report.stalled = True
                self.fail(f"stalled: no request resolved in {stall_timeout:.0f} s with {self.window} in flight")
                break
            report.requests += 1
            if case.broken:
                report.invalid += 1
            else:
                report.valid += 1
            try:
                request = case.request()
                future = engine.submit(request)
            except ValueError as exc:
                self.slots.release()
                if case.broken is None:
                    report.rejected_valid += 1
                    self.fail(f"case {case.index}: valid request rejected: {exc}")
                elif names_field(str(exc), case.broken):
                    report.rejected += 1
                    by_field = report.rejections_by_field
                    by_field[case.broken] = by_field.get(case.broken, 0) + 1
                else:
                    report.rejected_unnamed += 1
                    self.fail(f"case {case.index}: {case.how}: ValueError does not name {case.broken}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - any other exception at submit is a failure
                self.slots.release()
                report.submit_crashes += 1
                self.fail(f"case {case.index}: {case.how or 'valid'}: {type(exc).__name__} at submit: {exc}")
                continue
            if case.broken:
                report.accepted_invalid += 1
                self.fail(f"case {case.index}: {case.how}: invalid request accepted")
            if request.score_ids is not None:
                report.score_requests += 1
            rid = request.request_id
            with self.lock:
                self.in_flight[rid] = future
                self.submitted += 1
            future.add_done_callback(self._released(rid))
            live.append((case, request, future))
        return live

    # -------------------------------------------------------------------- results
    def check_all(self, live, timeout: float) -> None:
        report, engine = self.report, self.engine
        _, not_done = wait_futures([f for _, _, f in live], timeout=timeout)
        reasons: Counter = Counter()
        eos = tuple(engine.config.eos_token_ids)
        for case, request, future in live:
            rid = request.request_id
            if future in not_done:
                report.lost += 1
                history = [e.event for e in list(engine.events) if e.request_id == rid]
                self.fail(f"case {case.index} ({rid}): lost (unresolved after {timeout:.0f} s; aborted "
                          f"{rid in self.aborted_ids}, cancelled {rid in self.cancelled_ids}, events {history})")
                continue
            if case.broken:            # accepted although invalid: already counted as a failure
                continue
            if future.cancelled():
                if rid in self.cancelled_ids:
                    report.aborted += 1
                    reasons["cancelled"] += 1
                else:
                    report.wrong += 1
                    self.fail(f"case {case.index}: cancelled without the fuzzer cancelling it")
                continue
            try:
                result = future.result(timeout=0)
            except (CancelledError, Exception) as exc:  # noqa: BLE001
                report.errors += 1
                self.fail(f"case {case.index}: {type(exc).__name__}: {exc}")
                continue
            reasons[result.finish_reason] += 1
            if result.finish_reason == "error":
                report.errors += 1
                self.fail(f"case {case.index}: error result: {result.error}")
                continue
            served = request.prepared(max_seq_len=engine.max_seq_len, vocab_size=engine.vocab_size)
            served.params = dataclasses.replace(served.params, seed=result.seed if request.params.seed is None
                                                else served.params.seed)
            problem, how = check_result(served, result, tokenizer=self.tokenizer, eos_token_ids=eos,
                                        vocab_size=engine.vocab_size)
            if problem is None and how == "abort" and rid not in self.aborted_ids | self.cancelled_ids:
                problem = "aborted without the fuzzer aborting it"
            if problem is not None:
                report.wrong += 1
                self.fail(f"case {case.index} ({rid}): {problem}")
                continue
            if how == "abort":
                report.aborted += 1
                continue
            report.completed += 1
            report.stops_by_token += how == "token"
            report.stops_by_string += how == "string"
            report.completed_after_preemption += result.num_preemptions > 0
        report.finish_reasons = dict(sorted(reasons.items()))


def _probe_likely_tokens(engine, vocab_size: int, seed: int, timeout: float) -> list[int]:
    """Tokens a few greedy and sampled requests emit: stop tokens drawn from them do stop requests."""
    rng = random.Random(seed + 1)
    futures = [engine.submit(Request(_ids(rng, rng.randint(1, 24), vocab_size),
                                     SamplingParams(max_new_tokens=12, temperature=0.0 if i % 2 else 1.0,
                                                    seed=i), request_id=f"probe-{seed}-{i}"))
               for i in range(8)]
    counts: Counter = Counter()
    for future in futures:
        counts.update(future.result(timeout=timeout).token_ids)
    return [t for t, _ in counts.most_common(24)]


def _pages(engine) -> tuple[int, int, int]:
    """(free or evictable pages, pages held by someone, pages still in the prefix cache)."""
    allocator = engine.scheduler.allocator
    held = sum(allocator.refcount(p) > 0 for p in range(1, allocator.num_pages))
    return allocator.num_free, held, allocator.num_cached


def run_engine_fuzz(engine, tokenizer, *, requests: int = 2000, seed: int = 0, invalid_fraction: float = 0.3,
                    window: int | None = None, abort_fraction: float = 0.08, cancel_fraction: float = 0.02,
                    tick: float = 0.01, stall_timeout: float = 120.0, timeout: float = 600.0,
                    max_failures: int = 50) -> FuzzReport:
    """Fuzz a started ``Engine`` (with ``tokenizer``, ``scoring=True``) with ``requests`` seeded requests under
    disruptions; return the ``FuzzReport`` (``report.ok`` / ``report.problems()``). The engine is warmed up
    first (``compiled_after_warmup``) and its ``max_concurrency`` is restored at the end.

    ``window``: requests in flight at most (default 4 × ``max_slots``), so that aborts and cap changes hit
    running requests; ``abort_fraction`` / ``cancel_fraction``: aborts / cancels sent per submitted request;
    ``tick``: mean seconds between two disruptions. Timeouts: ``stall_timeout`` for a free place in the window
    (no request resolved meanwhile: the run stops submitting), ``timeout`` for every future and ``wait_idle``.
    """
    started = time.perf_counter()
    report = FuzzReport()
    window = window or 4 * engine.max_slots
    cap = engine.max_concurrency
    _call_with_timeout(engine.warmup, timeout, "warmup")
    report.compiled_after_warmup = engine.compiled_count()
    stats_before = dict(engine.stats)
    if not engine.wait_idle(timeout):
        raise RuntimeError("the engine is not idle before the fuzz")
    allocator = engine.scheduler.allocator
    report.pages_total = allocator.num_pages - 1
    report.pages_free_start = allocator.num_free

    vocab = engine.vocab_size
    rng = random.Random(seed + 2)
    odd = [tokenizer.encode(" ".join(rng.sample(ODD_TEXTS, 4)) * 4) for _ in range(8)]
    ctx = _Context(vocab_size=vocab, max_seq_len=engine.max_seq_len, max_slots=engine.max_slots,
                   eos_token_ids=tuple(engine.config.eos_token_ids),
                   likely_tokens=_probe_likely_tokens(engine, vocab, seed, timeout),
                   odd_prompts=odd, prefixes=[_ids(rng, rng.randint(16, 80), vocab) for _ in range(4)])
    if not engine.wait_idle(timeout):
        raise RuntimeError("the probe requests did not finish")
    cases = generate_cases(requests, seed, ctx, invalid_fraction)
    events_before = len(engine.events)

    fuzzer = _Fuzzer(engine, tokenizer, report, seed=seed, window=window, abort_fraction=abort_fraction,
                     cancel_fraction=cancel_fraction, tick=tick, max_failures=max_failures)
    disruptor = threading.Thread(target=fuzzer.disrupt, name="fuzz-disruptor", daemon=True)
    disruptor.start()
    try:
        live = fuzzer.submit_all(cases, stall_timeout)
        fuzzer.check_all(live, timeout)
    finally:
        fuzzer.stop.set()
        disruptor.join(timeout)
        if disruptor.is_alive():
            fuzzer.fail("the disruption thread did not stop")
    engine.max_concurrency = cap
    report.idle = engine.wait_idle(timeout)
    report.preemptions = engine.stats["preemptions"] - stats_before.get("preemptions", 0)
    report.preempt_events = sum(e.event == "preempt" for e in list(engine.events)[events_before:])
    report.pages_free_end, report.pages_held_end, report.pages_cached_end = _pages(engine)
    report.slots_free_end = len(getattr(engine.scheduler, "_free_slots", ()))
    if engine.scheduler.running or engine.scheduler.waiting:
        fuzzer.fail(f"scheduler not empty: {len(engine.scheduler.running)} running, "
                    f"{len(engine.scheduler.waiting)} waiting")
        report.idle = False
    report.compiled_end = engine.compiled_count()
    report.wall_s = round(time.perf_counter() - started, 2)
    return report


def _call_with_timeout(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on a helper thread, waited for at most ``timeout`` seconds (TimeoutError after)."""
    future: Future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)

    threading.Thread(target=run, name=f"fuzz-{what}", daemon=True).start()
    return future.result(timeout=timeout)


# ------------------------------------------------------------------------------------------------ the CLI
def micro_engine_config(**overrides):
    """The fuzz engine: 8 slots, 128-token sequences of 8 pages of 16, and 24 pages (23 usable, under three
    full sequences) so decode preempts; small prefill buckets (12 compiled shapes with scoring)."""
    from jaxopd.sampler import EngineConfig

    base = dict(max_slots=8, page_size=16, num_pages=24, max_seq_len=128, prefill_chunk=64,
                max_prefill_tokens=128, max_prefill_rows=4, record_events=True, scoring=True)
    return EngineConfig(**{**base, **overrides})


def build_micro_engine(*, seed: int = 0, **config_overrides):
    """(a not yet started ``Engine`` over a random micro Qwen3 with the real tokenizer's vocabulary, the real
    Qwen3 tokenizer)."""
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.sampler import Engine
    from jaxopd.tokenizer import QWEN3_VOCAB_SIZE, Qwen3Tokenizer

    config = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                         intermediate_size=32, vocab_size=QWEN3_VOCAB_SIZE, dtype="float32", param_dtype="float32")
    tokenizer = Qwen3Tokenizer()
    engine = Engine(CausalLM(config, rngs=nnx.Rngs(seed)), micro_engine_config(**config_overrides), tokenizer=tokenizer)
    return engine, tokenizer


def markdown(result: dict) -> str:
    r = result["report"]
    rows = [("requests fuzzed", r["requests"]), ("valid / invalid", f"{r['valid']} / {r['invalid']}"),
            ("rejected (ValueError naming the field)", r["rejected"]), ("completed", r["completed"]),
            ("aborted (by the fuzzer)", r["aborted"]), ("lost", r["lost"]),
            ("errors / wrong results", f"{r['errors']} / {r['wrong']}"),
            ("unnamed rejections / accepted invalid / crashes",
             f"{r['rejected_unnamed']} / {r['accepted_invalid']} / {r['submit_crashes']}"),
            ("score requests", r["score_requests"]),
            ("stops by token / by string", f"{r['stops_by_token']} / {r['stops_by_string']}"),
            ("aborts / cancels / unknown aborts sent",
             f"{r['aborts_sent']} / {r['cancels_sent']} / {r['unknown_aborts_sent']}"),
            ("max_concurrency changes (invalid refused)", f"{r['concurrency_changes']} ({r['concurrency_rejected']})"),
            ("preemptions (completed after one)", f"{r['preemptions']} ({r['completed_after_preemption']})"),
            ("pages free start / end of total", f"{r['pages_free_start']} / {r['pages_free_end']} of "
                                                f"{r['pages_total']} ({r['pages_cached_end']} cached, evictable)"),
            ("compiled after warm-up / at the end", f"{r['compiled_after_warmup']} / {r['compiled_end']}"),
            ("wall time", f"{r['wall_s']:.1f} s"), ("verdict", "OK" if r["ok"] else "; ".join(r["problems"]))]
    lines = [f"# Engine fuzz (seed {result['seed']})", "", "| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="requests to fuzz (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request generator and the disruptions")
    p.add_argument("--out", default="results/reliability", help="folder of fuzz_engine.json / .md")
    p.add_argument("--mixed-steps", default="auto", choices=["auto", "on", "off"],
                   help="the engine's mixed prefill + decode steps (auto: the backend's default, off on CPU)")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    if args.seed < 0:
        p.error("--seed must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    engine, tokenizer = build_micro_engine(
        seed=args.seed, mixed_steps={"auto": None, "on": True, "off": False}[args.mixed_steps])
    with engine:
        report = run_engine_fuzz(engine, tokenizer, requests=args.requests, seed=args.seed)
    config = engine.config
    result = {"seed": args.seed, "report": report.as_dict(),
              "engine": {"max_slots": config.max_slots, "page_size": config.page_size,
                         "num_pages": config.num_pages, "max_seq_len": config.max_seq_len,
                         "mixed_steps": config.uses_mixed_steps, "mixed_steps_run": engine.stats["mixed_steps"],
                         "model": "random micro Qwen3 (hidden 16, 1 layer) over the real Qwen3 tokenizer's "
                                  f"{engine.vocab_size:,} ids"}}
    write_result(result, markdown(result), Path(args.out) / "fuzz_engine.json")
    for failure in report.failures[:10]:
        print("  failure:", failure)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
