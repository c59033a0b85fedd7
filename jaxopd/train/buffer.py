"""Turn-level samples on their way from rollout to the optimizer: the FIFO buffer and batch collation.

Collates ``jaxopd.sample.Sample`` records (re-exported here). Owns the FIFO ``SampleBuffer`` that enforces the
version-lag bound (stale samples are dropped at batch construction, consumed samples never come back),
its checkpointable form, and collation of samples into a padded ``TrainBatch`` of host arrays.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from jaxopd.sample import Sample


# ----------------------------------------------------------------------------------------------------------
# The FIFO buffer
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BufferStats:
    added: int = 0
    consumed: int = 0
    dropped_stale: int = 0


class SampleBuffer:
    """First-in first-out samples with a version-lag bound (ActFirst-OPD App. B.4).

    ``take(n, current_version)`` first discards every buffered sample with
    ``current_version - policy_version > max_version_lag`` (lag <= 1 by default: samples of the current
    or the immediately preceding student), then removes and returns the ``n`` oldest remaining ones.
    Samples stay buffered until taken or dropped; a sample leaves the buffer exactly once.

    A collection (``Sample.collection >= 0``, ActionOPD) is judged as a whole: the lag rule applies to it
    until its first minibatch is taken; from then on its remaining samples are kept until they are taken, so
    one collection spans several minibatch updates (one epoch, ActionOPD App. A.4) without being dropped.
    """

    def __init__(self, max_version_lag: int = 1):
        if int(max_version_lag) != max_version_lag or max_version_lag < 0:
            raise ValueError(f"max_version_lag must be a non-negative integer, got {max_version_lag!r}")
        self.max_version_lag = int(max_version_lag)
        self._queue: collections.deque[Sample] = collections.deque()
        self._next_id = 0
        self._open_collections: set[int] = set()   # collections whose first minibatch was taken
        self.stats = BufferStats()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, samples: Iterable[Sample]) -> list[int]:
        """Appends samples (oldest first) and returns the ids the buffer gave them."""
        ids = []
        for sample in samples:
            if not isinstance(sample, Sample):
                raise ValueError(f"SampleBuffer.add takes Sample objects, got {type(sample).__name__}")
            if sample.sample_id >= 0:
                raise ValueError(f"sample {sample.sample_id} was already buffered once; a sample is never reused")
            sample = dataclasses.replace(sample, sample_id=self._next_id)
            self._next_id += 1
            self._queue.append(sample)
            ids.append(sample.sample_id)
        self.stats.added += len(ids)
        return ids

    def drop_stale(self, current_version: int) -> int:
        """Discards samples more than ``max_version_lag`` versions behind; returns how many."""
        newest = max((s.policy_version for s in self._queue), default=-1)
        if newest > current_version:
            raise ValueError(f"a buffered sample comes from policy version {newest}, newer than the current "
                             f"version {current_version}")
        oldest_allowed = current_version - self.max_version_lag
        kept = [s for s in self._queue if s.policy_version >= oldest_allowed or s.collection in self._open_collections]
        dropped = len(self._queue) - len(kept)
        self._queue = collections.deque(kept)
        self.stats.dropped_stale += dropped
        return dropped

    def available(self, current_version: int) -> int:
        """How many samples a ``take`` at ``current_version`` could return (nothing is removed)."""
        return sum(1 for s in self._queue if current_version - s.policy_version <= self.max_version_lag
                   or s.collection in self._open_collections)

    def take(self, batch_size: int, current_version: int, *, allow_partial: bool = False) -> list[Sample]:
        """Drops stale samples, then removes and returns the ``batch_size`` oldest.

        With fewer than ``batch_size`` fresh samples, returns ``[]`` and removes nothing fresh (or, with
        ``allow_partial``, returns all of them).
        """
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.drop_stale(current_version)
        if len(self._queue) < batch_size and not allow_partial:
            return []
        count = min(batch_size, len(self._queue))
        batch = [self._queue.popleft() for _ in range(count)]
        self.stats.consumed += count
        self._open_collections |= {s.collection for s in batch if s.collection >= 0}
        self._open_collections &= {s.collection for s in self._queue}    # a fully taken collection closes
        return batch

    # -- checkpointable form ---------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(metadata, arrays)``: JSON-serialisable bookkeeping and the concatenated per-token arrays.

        Arrays with no element are left out (checkpoint libraries refuse zero-size arrays).
        """
        samples = list(self._queue)
        metadata = {
            "max_version_lag": self.max_version_lag,
            "next_id": self._next_id,
            "stats": dataclasses.asdict(self.stats),
            "open_collections": sorted(self._open_collections),
            "samples": [{"sample_id": s.sample_id, "policy_version": s.policy_version, "length": len(s),
                         "advantage": s.advantage, "retained": s.retained, "collection": s.collection,
                         "has_teacher_logp": s.teacher_logp is not None,
                         "has_teacher_generated": s.teacher_generated is not None,
                         "has_loss_weight": s.loss_weight is not None} for s in samples],
        }
        arrays: dict[str, np.ndarray] = {}

        def concat(name, dtype):
            parts = [getattr(s, name) for s in samples if getattr(s, name) is not None]
            if parts and sum(p.size for p in parts):
                arrays[name] = np.concatenate(parts).astype(dtype)

        concat("tokens", np.int32)
        concat("loss_mask", np.bool_)
        concat("behavior_logp", np.float32)
        concat("teacher_logp", np.float32)
        concat("teacher_generated", np.bool_)
        concat("loss_weight", np.float32)
        return metadata, arrays

    @classmethod
    def from_state(cls, metadata: dict[str, Any], arrays: dict[str, np.ndarray]) -> "SampleBuffer":
        """Rebuilds a buffer from :meth:`state` (the same samples, ids, order and counters)."""
        buffer = cls(metadata["max_version_lag"])
        buffer._next_id = int(metadata["next_id"])
        buffer.stats = BufferStats(**metadata["stats"])
        buffer._open_collections = {int(c) for c in metadata.get("open_collections", ())}
        offsets = collections.Counter()

        def pop(name, length):
            start = offsets[name]
            offsets[name] += length
            return np.asarray(arrays[name][start:start + length])

        for entry in metadata["samples"]:
            length = entry["length"]
            buffer._queue.append(Sample(
                tokens=pop("tokens", length), loss_mask=pop("loss_mask", length),
                behavior_logp=pop("behavior_logp", length), policy_version=entry["policy_version"],
                teacher_logp=pop("teacher_logp", length) if entry["has_teacher_logp"] else None,
                teacher_generated=pop("teacher_generated", length) if entry["has_teacher_generated"] else None,
                advantage=entry["advantage"], retained=entry["retained"],
                collection=entry.get("collection", -1), sample_id=entry["sample_id"],
                loss_weight=pop("loss_weight", length) if entry.get("has_loss_weight") else None))
        for name, used in offsets.items():
            if used != arrays[name].shape[0]:
                raise ValueError(f"buffer checkpoint: array {name!r} has {arrays[name].shape[0]} entries, "
                                 f"the sample list accounts for {used}")
        return buffer


# ----------------------------------------------------------------------------------------------------------
# Collation
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """A padded batch of samples; per-token arrays ``[B, T]`` indexed by token position, per-response ``[B]``.

    Rows are right-padded (``attention_mask`` False, ``loss_mask`` False); padding rows (all False) stand
    for missing samples and add nothing to any loss. ``teacher_logp`` holds zeros until scored, and
    ``teacher_dense_logp`` and ``teacher_top_ids`` are empty (``[B, 0, 0]``) unless a dense scorer filled them.
    """

    tokens: Any              # [B, T] int32
    positions: Any           # [B, T] int32
    attention_mask: Any      # [B, T] bool
    loss_mask: Any           # [B, T] bool — supervised model-generated tokens
    behavior_logp: Any       # [B, T] float32
    teacher_logp: Any        # [B, T] float32
    teacher_generated: Any   # [B, T] bool (STI-OPD)
    advantages: Any          # [B] float32 (ActionOPD)
    retained: Any            # [B] bool (ActionOPD)
    policy_version: Any      # [B] int32 (-1 on padding rows)
    loss_weight: Any         # [B, T] float32 — weight of each supervised token (sft: sft_loss's token_weight;
                             # a sample's loss_weight, else 1 on loss_mask), 0 off loss_mask
    teacher_dense_logp: Any  # [B, W, V] float32 — opd-exact: the teacher's log-softmax at each row's first W
                             # supervised positions (score_batch with a dense scorer); [B, 0, 0] otherwise;
                             # with a top-K scorer [B, W, K + 1]: its top K log-probs, then the rest's
    teacher_top_ids: Any     # [B, W, K] int32 — the ids of those top K (top-K scorer); [B, 0, 0] otherwise

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def replace(self, **changes) -> "TrainBatch":
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(TrainBatch, data_fields=[f.name for f in dataclasses.fields(TrainBatch)],
                                 meta_fields=[])


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def collate_samples(samples: Sequence[Sample], *, batch_size: int | None = None, length: int | None = None,
                    length_multiple: int = 16, pad_token_id: int = 0) -> TrainBatch:
    """Right-pads ``samples`` into a ``TrainBatch`` of numpy arrays.

    ``length`` defaults to the longest sample rounded up to ``length_multiple`` (a few shapes, few
    recompiles); ``batch_size`` (default ``len(samples)``) adds empty padding rows.
    """
    samples = list(samples)
    batch_size = len(samples) if batch_size is None else batch_size
    if batch_size < 1 or len(samples) > batch_size:
        raise ValueError(f"collate_samples: {len(samples)} samples do not fit a batch of {batch_size}")
    longest = max((len(s) for s in samples), default=1)
    length = padded_length(longest, length_multiple) if length is None else length
    if longest > length:
        raise ValueError(f"collate_samples: a sample has {longest} tokens, more than the batch length {length}")
    tokens = np.full((batch_size, length), pad_token_id, np.int32)
    attention_mask = np.zeros((batch_size, length), bool)
    loss_mask = np.zeros((batch_size, length), bool)
    behavior_logp = np.zeros((batch_size, length), np.float32)
    teacher_logp = np.zeros((batch_size, length), np.float32)
    teacher_generated = np.zeros((batch_size, length), bool)
    advantages = np.zeros((batch_size,), np.float32)
    retained = np.zeros((batch_size,), bool)
    policy_version = np.full((batch_size,), -1, np.int32)
    loss_weight = np.zeros((batch_size, length), np.float32)
    for row, sample in enumerate(samples):
        n = len(sample)
        tokens[row, :n] = sample.tokens
        attention_mask[row, :n] = True
        loss_mask[row, :n] = sample.loss_mask
        behavior_logp[row, :n] = np.where(sample.loss_mask, sample.behavior_logp, 0.0)
        if sample.teacher_logp is not None:
            teacher_logp[row, :n] = sample.teacher_logp
        if sample.teacher_generated is not None:
            teacher_generated[row, :n] = sample.teacher_generated
        advantages[row] = sample.advantage
        retained[row] = sample.retained
        policy_version[row] = sample.policy_version
        loss_weight[row, :n] = sample.loss_mask if sample.loss_weight is None else np.where(
            sample.loss_mask, sample.loss_weight, 0.0)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch_size, length)).copy()
    return TrainBatch(tokens, positions, attention_mask, loss_mask, behavior_logp, teacher_logp,
                      teacher_generated, advantages, retained, policy_version, loss_weight,
                      np.zeros((batch_size, 0, 0), np.float32), np.zeros((batch_size, 0, 0), np.int32))


__all__ = ["Sample", "BufferStats", "SampleBuffer", "TrainBatch", "collate_samples", "padded_length"]
