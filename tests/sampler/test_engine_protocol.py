"""One engine surface: ``Engine`` and ``SimulatedEngine`` both satisfy ``EngineProtocol`` (at run time and by
signature), request kinds are open tags, and scheduling policies rank them without touching the scheduler."""
import asyncio
import inspect
import typing

import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM
from micro_models import SMALL, micro_config
from jaxopd.sampler import (POLICIES, Engine, EngineConfig, EngineProtocol, Request, SamplingParams,
                            SchedulingPolicy, SimulatedEngine)
from jaxopd.sampler.scheduler import scheduling_policy

CFG = micro_config(SMALL, vocab_size=64)
PROTOCOL_MEMBERS = ("submit", "submit_async", "abort", "max_concurrency", "update_weights", "wait_idle", "events")


def request(kind, request_id, priority=0, new=4):
    return Request([1, 2, 3], SamplingParams(max_new_tokens=new), kind=kind, priority=priority, request_id=request_id)


@pytest.fixture(scope="module")
def engine():
    return Engine(CausalLM(CFG, rngs=nnx.Rngs(0)), EngineConfig(max_slots=4, page_size=8, num_pages=16, max_seq_len=64,
                                                             prefill_chunk=16, max_prefill_tokens=64))


def test_both_engines_satisfy_the_protocol_at_run_time(engine):
    assert isinstance(engine, EngineProtocol)
    assert isinstance(SimulatedEngine({"fast": 1.0}), EngineProtocol)
    assert not isinstance(object(), EngineProtocol)


@pytest.mark.parametrize("cls", [Engine, SimulatedEngine])
def test_both_engines_match_the_protocol_signatures(cls):
    members = {name for name in dir(EngineProtocol) if not name.startswith("_")} | set(
        typing.get_type_hints(EngineProtocol))
    assert members == set(PROTOCOL_MEMBERS)
    for name in PROTOCOL_MEMBERS:
        declared = inspect.getattr_static(EngineProtocol, name, None)
        implemented = inspect.getattr_static(cls, name, None)
        if name == "events":
            continue                                 # an instance attribute: checked by isinstance above
        if isinstance(declared, property):
            assert isinstance(implemented, property) and implemented.fset is not None, (cls, name)
            continue
        assert implemented is not None, (cls, name)
        want, got = inspect.signature(declared), inspect.signature(implemented)
        assert [(p.name, p.kind, p.default) for p in want.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in got.parameters.values()], (cls, name, got)
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), (cls, name)


def test_kinds_are_open_tags(engine):
    for kind in ("fast", "full", "teacher", "candidate", "score"):
        request(kind, kind).validate(max_seq_len=64, vocab_size=64)
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="kind must be a non-empty string tag"):
            Request([1], SamplingParams(max_new_tokens=1), kind=bad).validate(max_seq_len=64, vocab_size=64)


def admission_order(policy, requests):
    """One slot, everything queued at t = 0: requests are admitted one by one in the policy's order."""
    engine = SimulatedEngine(lambda r: 1.0, policy=policy, max_slots=4)
    engine.max_concurrency = 1
    for r in requests:
        engine.submit(r)
    engine.wait_idle()
    return [e.request_id for e in engine.events if e.event == "admit"]


def test_policies_map_tags_to_ranks():
    queued = [request("candidate", "cand", priority=2), request("full", "full"),
              request("teacher", "teach", priority=1), request("fast", "fast", priority=3)]
    assert admission_order("fifo", queued) == ["cand", "full", "teach", "fast"]
    assert admission_order("fast-first", queued) == ["fast", "cand", "full", "teach"]
    assert admission_order("priority", queued) == ["full", "teach", "cand", "fast"]
    sti = SchedulingPolicy.by_kind("teacher-first", {"teacher": 0, "fast": 1}, default_rank=2)
    assert admission_order(sti, queued) == ["teach", "fast", "cand", "full"]
    assert set(POLICIES) == {"fifo", "fast-first", "priority"} and scheduling_policy(sti) is sti
    hash(EngineConfig(policy=sti))                    # a policy is a valid, hashable engine setting
    EngineConfig(policy=sti).validate()
    with pytest.raises(ValueError, match="EngineConfig.policy must be one of"):
        EngineConfig(policy="shortest-first").validate()
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        SimulatedEngine({"fast": 1.0}, policy="shortest-first")


def test_simulated_abort_update_weights_and_async():
    engine = SimulatedEngine({"fast": 1.0, "full": 4.0}, max_slots=2)
    engine.max_concurrency = 1
    running = engine.submit(request("full", "running"))
    waiting = engine.submit(request("fast", "waiting"))
    engine.abort("waiting")
    assert waiting.result().finish_reason == "abort" and waiting.result().token_ids == []
    engine.update_weights({"w": 1})
    assert engine.state == {"w": 1} and engine.wait_idle()
    result = running.result()
    assert result.finish_reason == "length" and result.token_ids == [0] * 4 and result.timings.total == 4.0
    assert [e.event for e in engine.events] == ["submit", "submit", "abort", "admit", "finish"]
    with pytest.raises(ValueError, match="max_concurrency must be in"):
        engine.max_concurrency = 3

    async def main():
        pending = asyncio.ensure_future(engine.submit_async(request("fast", "async")))
        await asyncio.sleep(0)
        engine.wait_idle()
        return await pending
    assert asyncio.run(main()).request_id == "async"
    assert [r.kind for r in engine.generate([request("full", "a"), request("fast", "b")])] == ["full", "fast"]
    np.testing.assert_array_equal(engine.generate([request("fast", "c")])[0].logprobs, np.zeros(4, np.float32))
