"""The ``Learner`` training LoRA adapters over a frozen student: it starts as the student (the first step's loss is
the whole-model learner's), only the adapters change (the base it keeps and the student's weights stay bit-equal),
the loss falls, ``model()`` and the pushed weights are the base with the adapters merged, and a learner restored from
its checkpoint (adapters and their optimizer state only) takes the same next step."""
import jax
import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.models.lora import LoraConfig, merged_model
from jaxopd.train import Learner, LossConfig, OptimizerConfig, RolePlan, Sample, build_meshes

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")
LORA = LoraConfig(rank=4, alpha=8.0)
BATCH, MAX_TOKENS = 4, 64


def samples(seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(BATCH):
        tokens = rng.integers(0, TINY.vocab_size, int(rng.integers(6, 12))).astype(np.int32)
        mask = np.zeros(len(tokens), bool)
        mask[3:] = True
        out.append(Sample(tokens, mask, np.zeros(len(tokens), np.float32), 0))
    return out


def learner(folder, meshes, lora=LORA):
    return Learner(CausalLM(TINY, rngs=nnx.Rngs(0)), LossConfig(kind="sft", temperature=1.0),
                   OptimizerConfig(learning_rate=1e-2, weight_decay=0.0), folder, batch_size=BATCH,
                   max_train_tokens=MAX_TOKENS, meshes=meshes, lora=lora, seed=3, log=lambda message: None)


def flat(state) -> dict:
    return {path: np.asarray(jax.device_get(v[...])) for path, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def meshes():
    return build_meshes(RolePlan.disjoint(4, 2, 2))


class Engine:
    def update_weights(self, params, *, version):
        self.params, self.version = params, version


@pytest.mark.slow  # three learners' compiled steps (run in CI: pytest -m slow)
def test_lora_learner_trains_adapters_only_and_resumes(meshes, tmp_path):
    student = flat(nnx.state(CausalLM(TINY, rngs=nnx.Rngs(0)), nnx.Param))
    whole = learner(tmp_path / "whole", meshes, lora=None)
    whole.restore_or_init()
    adapted = learner(tmp_path / "lora", meshes)
    assert adapted.restore_or_init() is None
    assert sorted(adapted.state.params) == sorted(f"{i}.{t}" for i in range(2) for t in LORA.targets)
    for path, value in flat(adapted.model_params()).items():
        np.testing.assert_array_equal(value, student[path])                 # b = 0: the student itself

    batch = adapted.collate(samples(0))
    first = adapted.step(adapted.place(batch))
    assert first["loss"] == pytest.approx(whole.step(whole.place(batch))["loss"], rel=1e-6)
    assert first["grad_norm"] > 0
    losses = [first["loss"]] + [adapted.step(adapted.place(batch))["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses

    for path, value in flat(adapted._base).items():
        np.testing.assert_array_equal(value, student[path])                 # the base never moves
    adapters = adapted.adapters()
    assert any(np.abs(pair["b"]).max() > 0 for pair in adapters.values())
    expected = flat(nnx.state(merged_model(CausalLM(TINY, rngs=nnx.Rngs(0)), adapters, LORA), nnx.Param))
    got = flat(nnx.state(adapted.model(), nnx.Param))
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-6)
    engine = Engine()
    adapted.push(engine)
    assert engine.version == 5
    pushed = flat(engine.params)
    for path in expected:
        np.testing.assert_allclose(pushed[path], expected[path], atol=1e-6)

    adapted.save(None, {"cursor": 1})
    following = adapted.step(adapted.place(adapted.collate(samples(1))))
    adapted.close()
    again = learner(tmp_path / "lora", meshes)
    restored = again.restore_or_init()
    assert restored.step == 5 and again.version == 5
    assert again.step(again.place(again.collate(samples(1))))["loss"] == following["loss"]
    again.close()
    whole.close()


def test_a_learner_without_lora_has_no_adapters(meshes, tmp_path):
    whole = learner(tmp_path / "whole", meshes, lora=None)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        whole.adapters()
    whole.close()
