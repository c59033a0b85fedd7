"""Paged-KV-cache sampler with continuous batching: public types and the engine."""
from jaxopd.sampler.engine import Engine, EngineConfig, EngineEvent
from jaxopd.sampler.types import Request, Result, SamplingParams, Timings

__all__ = ["Engine", "EngineConfig", "EngineEvent", "Request", "Result", "SamplingParams", "Timings"]
