"""The agent protocol: prompts (App. B.1-B.2), answer tags, action strings, budgeted thinking (App. B.3) and
rollout-quality metrics (App. C.5); the rollout strategies build on these to drive the sampler and environments."""
