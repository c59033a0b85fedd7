"""The FIFO sample buffer: version-lag bound, no sample yielded twice, checkpointable state; collation."""
import random

import numpy as np
import pytest

from jaxopd.train.buffer import Sample, SampleBuffer, collate_samples


def make_sample(version, length=6, prompt=2, seed=0, **extra):
    rng = np.random.default_rng(seed)
    return Sample(tokens=rng.integers(0, 50, length), loss_mask=np.arange(length) >= prompt,
                  behavior_logp=-rng.random(length).astype(np.float32), policy_version=version, **extra)


def test_fifo_order_and_version_lag_of_one():
    buffer = SampleBuffer()
    ids = buffer.add([make_sample(0, seed=i) for i in range(3)])
    assert ids == [0, 1, 2]
    assert [s.sample_id for s in buffer.take(2, current_version=0)] == [0, 1]
    buffer.add([make_sample(1, seed=3)])
    buffer.add([make_sample(2, seed=4), make_sample(2, seed=5)])
    # at version 2, sample 2 (version 0, lag 2) is dropped; sample 3 (version 1, lag 1) is still usable
    assert buffer.available(2) == 3
    taken = buffer.take(2, current_version=2)
    assert [(s.sample_id, s.policy_version) for s in taken] == [(3, 1), (4, 2)]
    assert buffer.stats.dropped_stale == 1 and buffer.stats.consumed == 4 and buffer.stats.added == 6
    assert len(buffer) == 1


def test_not_enough_fresh_samples_returns_nothing_unless_partial():
    buffer = SampleBuffer()
    buffer.add([make_sample(3, seed=1), make_sample(3, seed=2)])
    assert buffer.take(3, current_version=4) == []
    assert len(buffer) == 2          # fresh samples stay buffered for the next update
    assert [s.sample_id for s in buffer.take(3, current_version=4, allow_partial=True)] == [0, 1]
    assert len(buffer) == 0


def test_lag_zero_keeps_only_the_current_version():
    buffer = SampleBuffer(max_version_lag=0)
    buffer.add([make_sample(0, seed=0), make_sample(1, seed=1)])
    assert [s.policy_version for s in buffer.take(1, current_version=1)] == [1]
    assert buffer.stats.dropped_stale == 1


def test_random_schedule_never_yields_a_sample_twice_nor_a_stale_one():
    rng = random.Random(0)
    buffer = SampleBuffer(max_version_lag=1)
    version, seen, added = 0, [], 0
    for _ in range(200):
        if rng.random() < 0.6:
            count = rng.randint(1, 4)
            # rollout engines may still deliver samples of the previous version after a sync
            buffer.add([make_sample(max(0, version - rng.randint(0, 2)), seed=added + i) for i in range(count)])
            added += count
        else:
            batch = buffer.take(rng.randint(1, 3), current_version=version)
            assert all(version - s.policy_version <= 1 for s in batch)
            seen.extend(s.sample_id for s in batch)
            if batch and rng.random() < 0.5:
                version += 1
    assert len(seen) == len(set(seen))
    assert seen == sorted(seen)                      # FIFO
    assert buffer.stats.consumed == len(seen)
    assert buffer.stats.consumed + buffer.stats.dropped_stale + len(buffer) == buffer.stats.added == added
    assert buffer.stats.dropped_stale > 0


def test_consumed_samples_cannot_be_added_again():
    buffer = SampleBuffer()
    buffer.add([make_sample(0)])
    (sample,) = buffer.take(1, current_version=0)
    with pytest.raises(ValueError, match="never reused"):
        buffer.add([sample])
    with pytest.raises(ValueError, match="Sample objects"):
        buffer.add([{"tokens": [1, 2]}])


def test_samples_newer_than_the_trainer_are_an_error():
    buffer = SampleBuffer()
    buffer.add([make_sample(5)])
    with pytest.raises(ValueError, match="newer than the current version 4"):
        buffer.take(1, current_version=4)


def test_state_round_trip_keeps_samples_ids_and_counters():
    buffer = SampleBuffer()
    buffer.add([make_sample(0, seed=0), make_sample(1, length=9, seed=1, teacher_logp=-np.ones(9),
                                                     teacher_generated=np.arange(9) >= 5),
                make_sample(1, seed=2, advantage=-0.75, retained=False)])
    buffer.take(1, current_version=1)
    metadata, arrays = buffer.state()
    assert set(arrays) == {"tokens", "loss_mask", "behavior_logp", "teacher_logp", "teacher_generated"}
    assert arrays["tokens"].shape == (15,) and arrays["teacher_logp"].shape == (9,)
    restored = SampleBuffer.from_state(metadata, arrays)
    assert restored.stats == buffer.stats and len(restored) == 2
    for a, b in zip(restored.take(2, current_version=1), buffer.take(2, current_version=1)):
        assert (a.sample_id, a.policy_version, a.advantage, a.retained) == (b.sample_id, b.policy_version,
                                                                            b.advantage, b.retained)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.behavior_logp, b.behavior_logp)
        assert (a.teacher_logp is None) == (b.teacher_logp is None)
    assert restored.add([make_sample(1, seed=9)]) == [3]   # ids continue
    empty_metadata, empty_arrays = SampleBuffer().state()
    assert empty_arrays == {} and len(SampleBuffer.from_state(empty_metadata, empty_arrays)) == 0


def test_loss_weights_survive_the_state_round_trip_and_are_checked():
    weighted = make_sample(1, seed=3, loss_weight=np.array([0, 0, 1, 2, 3, 4], np.float32))
    buffer = SampleBuffer()
    buffer.add([make_sample(1, seed=2), weighted])
    metadata, arrays = buffer.state()
    assert arrays["loss_weight"].shape == (6,)
    restored = SampleBuffer.from_state(metadata, arrays).take(2, current_version=1)
    assert restored[0].loss_weight is None
    np.testing.assert_array_equal(restored[1].loss_weight, [0, 0, 1, 2, 3, 4])
    batch = collate_samples(restored, length_multiple=8)
    np.testing.assert_array_equal(batch.loss_weight, [[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 2, 3, 4, 0, 0]])
    with pytest.raises(ValueError, match="loss_weight must be finite and >= 0"):
        make_sample(1, loss_weight=np.array([0, 0, 1, -1, 1, 1]))
    with pytest.raises(ValueError, match="loss_weight must have shape"):
        make_sample(1, loss_weight=np.ones(5))


def test_sample_validation():
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must be False"):
        Sample(np.arange(4), np.ones(4, bool), np.zeros(4), 0)
    with pytest.raises(ValueError, match="behavior_logp must have shape"):
        Sample(np.arange(4), np.arange(4) > 1, np.zeros(3), 0)
    with pytest.raises(ValueError, match="integers"):
        Sample(np.arange(4.0), np.arange(4) > 1, np.zeros(4), 0)
    with pytest.raises(ValueError, match="policy_version"):
        Sample(np.arange(4), np.arange(4) > 1, np.zeros(4), -1)
    with pytest.raises(ValueError, match="finite"):
        Sample(np.arange(4), np.arange(4) > 1, np.array([0, 0, -np.inf, 0]), 0)


def test_collate_right_pads_and_adds_empty_rows():
    a = Sample(np.array([5, 6, 7]), np.array([0, 0, 1], bool), np.array([0, 0, -0.5]), 2,
               teacher_generated=np.array([0, 0, 1], bool), advantage=1.5)
    b = Sample(np.array([1, 2, 3, 4, 9]), np.array([0, 1, 1, 0, 1], bool), np.array([9, -1, -2, 9, -3]), 3,
               teacher_logp=np.array([0, -4, -5, -6, -7]), retained=False)
    batch = collate_samples([a, b], batch_size=4, length_multiple=4, pad_token_id=0)
    assert batch.shape == (4, 8)
    np.testing.assert_array_equal(batch.tokens[:2], [[5, 6, 7, 0, 0, 0, 0, 0], [1, 2, 3, 4, 9, 0, 0, 0]])
    np.testing.assert_array_equal(batch.attention_mask.sum(1), [3, 5, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [0, 1, 1, 0, 1, 0, 0, 0])
    # behaviour log-probs are zeroed outside supervised tokens
    np.testing.assert_array_equal(batch.behavior_logp[1], [0, -1, -2, 0, -3, 0, 0, 0])
    np.testing.assert_array_equal(batch.teacher_logp[1, :5], [0, -4, -5, -6, -7])
    np.testing.assert_array_equal(batch.teacher_generated[0, :3], [0, 0, 1])
    np.testing.assert_array_equal(batch.advantages, [1.5, 0, 0, 0])
    np.testing.assert_array_equal(batch.retained, [True, False, False, False])
    np.testing.assert_array_equal(batch.policy_version, [2, 3, -1, -1])
    np.testing.assert_array_equal(batch.positions[3], np.arange(8))
    assert not batch.loss_mask[2:].any()
    with pytest.raises(ValueError, match="more than the batch length 4"):
        collate_samples([b], length=4)
    with pytest.raises(ValueError, match="do not fit a batch of 1"):
        collate_samples([a, b], batch_size=1)


def test_a_collection_spans_several_minibatch_updates():
    """ActionOPD trains one collection for an epoch of minibatches: once its first minibatch is taken, the
    lag rule no longer drops the rest; an untouched stale collection is still dropped."""
    buffer = SampleBuffer(max_version_lag=1)
    buffer.add([make_sample(0, seed=i, collection=7) for i in range(6)])
    first = buffer.take(2, current_version=0)
    second = buffer.take(2, current_version=1)
    third = buffer.take(2, current_version=2)           # lag 2 > 1, but the collection is being consumed
    assert [len(b) for b in (first, second, third)] == [2, 2, 2]
    assert buffer.stats.dropped_stale == 0 and len(buffer) == 0
    buffer.add([make_sample(2, seed=9, collection=8), make_sample(2, seed=10, collection=8)])
    assert buffer.take(1, current_version=4) == [] and buffer.stats.dropped_stale == 2   # never started: stale
    buffer.add([make_sample(5, seed=11, collection=9), make_sample(5, seed=12, collection=9)])
    buffer.take(1, current_version=5)
    metadata, arrays = buffer.state()
    restored = SampleBuffer.from_state(metadata, arrays)
    assert [s.collection for s in restored.take(1, current_version=9)] == [9]   # the open collection survives resume


def test_collection_must_be_an_integer():
    with pytest.raises(ValueError, match="collection"):
        make_sample(0, collection=True)
