"""Paged-KV-cache sampler with continuous batching: the engine surface, its public types and two engines.

``EngineProtocol`` is what callers program against; ``Engine`` serves a ``CausalLM`` (Qwen3 or Llama) on a device,
``SimulatedEngine`` (``jaxopd.sampler.simulated``) replays the same scheduling on a virtual clock.
"""
from jaxopd.sampler.engine import Engine, EngineConfig, fine_length_step
from jaxopd.sampler.protocol import EngineProtocol
from jaxopd.sampler.scheduler import POLICIES, SchedulingPolicy
from jaxopd.sampler.simulated import SimulatedEngine
from jaxopd.sampler.types import EngineEvent, Request, Result, SamplingParams, Timings

__all__ = ["Engine", "EngineConfig", "EngineEvent", "EngineProtocol", "POLICIES", "Request", "Result",
           "SamplingParams", "SchedulingPolicy", "SimulatedEngine", "Timings", "fine_length_step"]
