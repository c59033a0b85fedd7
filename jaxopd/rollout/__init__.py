"""Rollout strategies and their host-side helpers (prompts, metrics): orchestration of sampler and environments."""
