"""The training sample: one turn-level response in its context, as rollouts produce it and the trainer consumes it.

Owns ``Sample`` and its checks. It sits below both rollout and train (it imports numpy only), so that the rollout
strategies that make samples need nothing of the trainer that consumes them.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One turn-level response in its context; every per-token array is indexed by token position.

    tokens: ``[L]`` int — context (prompt, history, inserted tokens) followed by the response.
    loss_mask: ``[L]`` bool — True on the model-generated tokens that are supervised; position 0 has no
      context to be predicted from and must be False.
    behavior_logp: ``[L]`` float — log-probability of each token under the policy that sampled it (0 where
      ``loss_mask`` is False).
    policy_version: the student version whose weights generated the response.
    teacher_logp: optional ``[L]`` float — the teacher's log-probabilities of the tokens, when the rollout
      already computed them (STI does for its discrepancy score); otherwise the teacher scorer fills them.
    teacher_generated: optional ``[L]`` bool — STI-OPD: True on tokens the teacher generated.
    advantage / retained: ActionOPD's response advantage A_{g,i} and whether its group was retained.
    collection: ActionOPD's collection id (``-1``: none). The samples of one collection are one behaviour
      snapshot trained for one epoch of minibatches (ActionOPD App. A.4); once its first minibatch is taken,
      the buffer's lag rule no longer drops the rest (see ``SampleBuffer``).
    sample_id: assigned by the buffer (``-1`` before).
    loss_weight: optional ``[L]`` float >= 0 — the weight of each supervised token in the loss (``sft``:
      ``losses.sft_loss``'s ``token_weight``; None: every supervised token weighs 1).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behavior_logp: np.ndarray
    policy_version: int
    teacher_logp: np.ndarray | None = None
    teacher_generated: np.ndarray | None = None
    advantage: float = 0.0
    retained: bool = True
    collection: int = -1
    sample_id: int = -1
    loss_weight: np.ndarray | None = None

    def __post_init__(self):
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or tokens.size < 2:
            raise ValueError(f"Sample.tokens must be a 1-D array of at least 2 tokens, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"Sample.tokens must be integers, got {tokens.dtype}")
        object.__setattr__(self, "tokens", tokens.astype(np.int32))
        length = tokens.shape[0]

        def per_token(name, dtype):
            value = getattr(self, name)
            if value is None:
                return
            value = np.asarray(value)
            if value.shape != (length,):
                raise ValueError(f"Sample.{name} must have shape ({length},) like tokens, got {value.shape}")
            object.__setattr__(self, name, value.astype(dtype))

        for required in ("loss_mask", "behavior_logp"):
            if getattr(self, required) is None:
                raise ValueError(f"Sample.{required} is required")
        per_token("loss_mask", bool)
        per_token("behavior_logp", np.float32)
        per_token("teacher_logp", np.float32)
        per_token("teacher_generated", bool)
        per_token("loss_weight", np.float32)
        if self.loss_weight is not None and not np.all(np.isfinite(self.loss_weight) & (self.loss_weight >= 0)):
            raise ValueError("Sample.loss_weight must be finite and >= 0")
        if self.loss_mask[0]:
            raise ValueError("Sample.loss_mask[0] must be False: the first token has no context to predict it from")
        if not np.all(np.isfinite(self.behavior_logp[self.loss_mask])):
            raise ValueError("Sample.behavior_logp must be finite on supervised tokens")
        if int(self.policy_version) != self.policy_version or self.policy_version < 0:
            raise ValueError(f"Sample.policy_version must be a non-negative integer, got {self.policy_version!r}")
        object.__setattr__(self, "policy_version", int(self.policy_version))
        object.__setattr__(self, "advantage", float(self.advantage))
        object.__setattr__(self, "retained", bool(self.retained))
        if isinstance(self.collection, bool) or int(self.collection) != self.collection or self.collection < -1:
            raise ValueError(f"Sample.collection must be an integer >= -1, got {self.collection!r}")
        object.__setattr__(self, "collection", int(self.collection))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


__all__ = ["Sample"]
