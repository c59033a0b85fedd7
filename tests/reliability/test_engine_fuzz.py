"""Engine fuzz (reliability, part 1): ``bench.fuzz_engine`` on micro Qwen3 engines with the real tokenizer, the
checks of its driver, and regression tests of the engine defects the fuzz found.

The slow test is the issue's full run (2,000 requests, preemption forced by a 24-page pool); the fast one fuzzes
150 requests on an engine with fewer compiled shapes so the default suite covers the driver.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import FIRST_COMPLETED, as_completed, wait

import numpy as np
import pytest
from flax import nnx

from bench.fuzz_engine import (
    FuzzReport,
    build_micro_engine,
    check_result,
    first_stop,
    names_field,
    run_engine_fuzz,
)
from jaxopd.models.decoder import CausalLM
from micro_models import SMALL, micro_config
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
from jaxopd.sampler.types import Result, Timings

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

TINY = micro_config(SMALL, vocab_size=64)
TINY_ENGINE = EngineConfig(max_slots=4, page_size=16, num_pages=32, max_seq_len=64, prefill_chunk=32,
                           max_prefill_tokens=32, max_prefill_rows=4, eos_token_ids=())
# The fast fuzz: 4 slots, 64-token sequences of 4 pages, 11 usable pages; 5 shapes to compile
FAST = dict(max_slots=4, num_pages=12, max_seq_len=64, prefill_chunk=16, max_prefill_tokens=64)


def assert_fuzz_passed(report: FuzzReport, requests: int) -> None:
    """Every expectation of the issue, each asserted on its own figure."""
    detail = "\n".join(report.failures)
    assert report.requests == requests, detail
    assert report.lost == 0, detail
    assert report.errors == 0 and report.wrong == 0, detail
    assert report.rejected_unnamed == 0 and report.accepted_invalid == 0, detail
    assert report.rejected_valid == 0 and report.submit_crashes == 0, detail
    assert report.concurrency_failures == 0, detail
    assert not report.stalled and report.idle, detail
    assert report.invalid > 0 and report.rejected == report.invalid          # every invalid one refused
    assert report.valid == report.completed + report.aborted                 # every valid one accounted for
    assert report.completed > 0.7 * report.valid
    assert report.pages_free_start == report.pages_total
    assert report.pages_free_end == report.pages_total and report.pages_held_end == 0   # every page returned
    assert report.compiled_end == report.compiled_after_warmup                 # nothing recompiled
    assert report.ok and report.problems() == [], report.problems()


# ------------------------------------------------------------------------------------------------ the fuzz
@pytest.fixture(scope="module")
def fast_engine():
    engine, tokenizer = build_micro_engine(seed=0, **FAST)
    with engine:
        yield engine, tokenizer


def test_engine_fuzz_150_requests(fast_engine):
    engine, tokenizer = fast_engine
    report = run_engine_fuzz(engine, tokenizer, requests=150, seed=3, timeout=300)
    assert_fuzz_passed(report, 150)
    assert report.score_requests > 0 and report.finish_reasons.get("length", 0) > 0
    assert report.concurrency_changes > 0
    assert engine.max_concurrency == engine.max_slots                          # the cap is restored


@pytest.mark.slow
def test_engine_fuzz_2000_requests():
    engine, tokenizer = build_micro_engine(seed=0)
    with engine:
        report = run_engine_fuzz(engine, tokenizer, requests=2000, seed=0, timeout=600)
    print(f"\nengine fuzz: {report.requests} fuzzed, {report.rejected} rejected, {report.completed} completed, "
          f"{report.aborted} aborted, {report.lost} lost; {report.preemptions} preemptions, "
          f"{report.concurrency_changes} cap changes, {report.wall_s:.0f} s")
    assert_fuzz_passed(report, 2000)
    assert report.preemptions >= 1 and report.preempt_events == report.preemptions   # the pool forced preemption
    assert report.completed_after_preemption >= 1
    assert report.aborts_sent > 0 and report.cancels_sent > 0 and report.aborted > 0
    assert report.concurrency_changes > 0 and report.concurrency_rejected > 0
    assert report.score_requests > 0 and report.stops_by_string > 0
    assert set(report.rejections_by_field) >= {"prompt_ids", "max_new_tokens", "temperature", "top_p", "top_k",
                                               "stop_strings", "stop_token_ids", "seed", "score_ids"}


# ------------------------------------------------------------------------------------------------ the checks
class Letters:
    """Token t decodes to one letter ("a" + t % 26)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def result(request_id, tokens, reason, text=None):
    return Result(request_id=request_id, kind="full", prompt_ids=(1, 2), token_ids=list(tokens),
                  text=Letters().decode(tokens) if text is None else text,
                  logprobs=np.full(len(tokens), -1.0, np.float32), finish_reason=reason,
                  timings=Timings(0, 0, 0, 0), seed=7)


def test_checks_accept_exact_results_and_flag_wrong_ones():
    params = SamplingParams(max_new_tokens=5, min_new_tokens=2, stop_token_ids=(3,), stop_strings=("xy",), seed=7)
    request = Request([1, 2], params, request_id="r")
    check = dict(tokenizer=Letters(), eos_token_ids=(9,), vocab_size=64)
    assert check_result(request, result("r", [0, 1, 2, 4, 5], "length"), **check) == (None, "length")
    assert check_result(request, result("r", [3, 0, 3], "stop"), **check) == (None, "token")   # 1st: before min
    assert check_result(request, result("r", [0, 23, 24], "stop"), **check) == (None, "string")    # "axy"
    assert check_result(request, result("r", [0, 9], "stop"), **check) == (None, "token")          # eos
    assert check_result(request, result("r", [0, 1, 2], "abort"), **check) == (None, "abort")
    wrong = [result("r", [0, 1, 2, 4], "length"),            # one token short
             result("r", [0, 1, 3, 4, 5], "length"),         # ran past a stop token
             result("r", [0, 1, 2], "stop"),                 # stopped without a stop
             result("r", [0, 3, 3], "stop"),                 # the first stop (token 2) was ignored
             result("r", [0, 1, 2, 4, 5], "length", text="nope"),
             result("r", [0, 1], "error"),
             result("other", [0, 1, 2, 4, 5], "length")]
    for bad in wrong:
        problem, _ = check_result(request, bad, **check)
        assert problem is not None, bad
    nan = dataclasses.replace(result("r", [0, 1, 2, 4, 5], "length"), logprobs=np.array([0, 0, np.nan, 0, 0]))
    assert "finite" in check_result(request, nan, **check)[0]


def test_first_stop_follows_the_incremental_text_rule():
    params = SamplingParams(max_new_tokens=9, min_new_tokens=3, stop_strings=("bc",))
    # "bc" completes at token 3 (counted: 3 >= min_new_tokens); at token 2 it would be too early
    assert first_stop([0, 1, 2, 0], params, (), Letters()) == (3, "string")
    assert first_stop([1, 2, 0, 0], params, (), Letters()) == (None, "")   # ended before min_new_tokens


def test_names_field_needs_the_whole_word():
    assert names_field("top_p must be in (0, 1]", "top_p")
    assert not names_field("top_pp must be set", "top_p") and not names_field("stop_token_ids", "token_ids")
    assert names_field("prompt of 9 tokens + max_new_tokens 4 exceeds max_seq_len 8: shorten prompt_ids or lower "
                       "max_new_tokens", "prompt_ids")


# ------------------------------------------------------------------------------------------------ regressions
@pytest.fixture(scope="module")
def tiny_model():
    return CausalLM(TINY, rngs=nnx.Rngs(0))


def test_cancelled_future_counts_as_done_for_wait_and_as_completed(tiny_model):
    """Found by the fuzz: ``concurrent.futures.wait`` / ``as_completed`` never returned for a cancelled
    request (the engine never called ``set_running_or_notify_cancel``), so a fuzz run lost cancelled requests."""
    engine = Engine(tiny_model, TINY_ENGINE)                   # not started: requests wait, nothing compiles
    futures = [engine.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=4))) for _ in range(2)]
    assert futures[0].cancel()
    done, not_done = wait(futures, timeout=5, return_when=FIRST_COMPLETED)
    assert done == {futures[0]} and not_done == {futures[1]}
    assert list(as_completed(futures[:1], timeout=5)) == futures[:1]
    assert engine.wait_idle(0.1) is False                      # the other one is still queued
    assert len(engine.scheduler.waiting) == 1                  # the cancelled one was aborted
    engine.stop()
    assert isinstance(futures[1].exception(timeout=5), RuntimeError)


def test_aborted_score_request_returns_no_tokens(tiny_model):
    """Found by the fuzz: an aborted score request returned its whole completion as ``token_ids`` with no
    log-probs (and its text), breaking ``len(logprobs) == len(token_ids)``."""
    engine = Engine(tiny_model, TINY_ENGINE, tokenizer=Letters())
    future = engine.submit(Request.scoring([1, 2, 3], [4, 5, 6], request_id="scored"))
    engine.abort("scored")
    r = future.result(timeout=5)
    assert r.finish_reason == "abort" and r.token_ids == [] and r.logprobs.shape == (0,) and r.text == ""
    assert engine.wait_idle(5) and engine.scheduler.allocator.num_used == 0
    engine.stop()


@pytest.mark.parametrize("fields,field", [
    (dict(prompt_ids=[1] * 70, params=SamplingParams(max_new_tokens=4)), "prompt_ids"),
    (dict(prompt_ids=[1] * 10, params=SamplingParams(max_new_tokens=60)), "max_new_tokens"),
    (dict(prompt_ids=[1] * 60, params=SamplingParams(max_new_tokens=1), score_ids=[2] * 10), "score_ids"),
    (dict(prompt_ids=[1] * 60, params=SamplingParams(max_new_tokens=1), score_ids=[2] * 10), "prompt_ids"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4, temperature=10 ** 400)), "temperature"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4, temperature=-(10 ** 400))), "temperature"),
])
def test_rejections_name_the_field(tiny_model, fields, field):
    """Found by the fuzz: a too-long prompt was refused without naming ``prompt_ids``; a temperature too large
    for a float raised ``OverflowError`` instead of ``ValueError``."""
    engine = Engine(tiny_model, TINY_ENGINE)
    with pytest.raises(ValueError) as info:
        engine.submit(Request(**fields))
    assert names_field(str(info.value), field), str(info.value)
    assert engine.wait_idle(1)
