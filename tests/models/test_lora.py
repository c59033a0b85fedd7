"""``jaxopd.models.lora``: zero ``b`` leaves the base unchanged; ``merge`` adds ``alpha / r · a @ b`` to the adapted
weights only and leaves the base state untouched; the adapters' gradient is the chain rule through the merged weight
(``∂L/∂a = s · G bᵀ``, ``∂L/∂b = s · aᵀ G`` with ``G`` the weight's gradient); a saved adapter folder is PEFT's
layout: transformers' model with ``W += s · B @ A`` added by hand (an independent reference) gives our merged logits;
``folders.load_folder`` rebuilds the model, also over a cut base and over another adapter folder; bad folders are
refused naming the problem."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import make_hf_qwen3
from jaxopd.models.folders import base_reference, load_folder, save_adapted
from jaxopd.models.lora import TARGETS, LoraConfig, init_adapters, load_adapters, merge, merged_model, save_adapters
from jaxopd.models.weights import CheckpointError, cut_layers, load_model

PROMPT = [3, 17, 99, 250, 7, 41, 300, 12]
CONFIG = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_lora_base")
    torch_model = make_hf_qwen3(folder, tied=True, seed=5, num_hidden_layers=2)
    return folder, torch_model


def random_adapters(model, config=CONFIG, seed=0):
    params = nnx.state(model, nnx.Param)
    adapters = init_adapters(params, config, jax.random.key(seed), num_layers=model.config.num_layers)
    keys = jax.random.split(jax.random.key(seed + 1), len(adapters))
    return {name: {"a": pair["a"], "b": 0.05 * jax.random.normal(k, pair["b"].shape)}
            for k, (name, pair) in zip(keys, adapters.items())}


def logits(model) -> np.ndarray:
    return np.asarray(model(np.asarray([PROMPT], np.int32)))[0]


def test_fresh_adapters_leave_the_model_unchanged(base):
    model = load_model(base[0], dtype="float32")
    params = nnx.state(model, nnx.Param)
    adapters = init_adapters(params, CONFIG, jax.random.key(0), num_layers=2)
    assert len(adapters) == 2 * 7
    assert adapters["0.q_proj"]["a"].shape == (model.config.hidden_size, 4)
    assert adapters["1.o_proj"]["a"].shape == (model.config.num_heads * model.config.head_dim, 4)
    assert adapters["1.down_proj"]["b"].shape == (4, model.config.hidden_size)
    np.testing.assert_array_equal(logits(merged_model(model, adapters, CONFIG)), logits(model))


def test_merge_adds_the_scaled_product_to_the_adapted_weights_only(base):
    model = load_model(base[0], dtype="float32")
    params = nnx.state(model, nnx.Param)
    before = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}
    adapters = random_adapters(model)
    merged = dict(nnx.to_flat_state(merge(params, adapters, CONFIG)))
    after = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}
    target_of = {path: target for target, (path, _, _) in TARGETS.items()}
    adapted = 0
    for path, value in before.items():
        np.testing.assert_array_equal(after[path], value)                       # the base state is untouched
        target = target_of.get(tuple(path[2:])) if path[0] == "layers" else None
        if target is None:
            np.testing.assert_array_equal(np.asarray(merged[path][...]), value)
            continue
        pair = adapters[f"{path[1]}.{target}"]
        expected = value + 2.0 * (np.asarray(pair["a"]) @ np.asarray(pair["b"])).reshape(value.shape)
        np.testing.assert_allclose(np.asarray(merged[path][...]), expected, atol=1e-6)
        assert np.abs(expected - value).max() > 1e-3
        adapted += 1
    assert adapted == 2 * 7


def test_adapter_gradients_are_the_chain_rule_through_the_merged_weight(base):
    model = load_model(base[0], dtype="float32")
    graphdef, params = nnx.split(model, nnx.Param)
    adapters = random_adapters(model)
    tokens = jnp.asarray([PROMPT], jnp.int32)

    def loss_of_params(p):
        return jnp.sum(jax.nn.log_softmax(nnx.merge(graphdef, p)(tokens))[0, :, 7] * jnp.arange(8.0))

    grads = jax.grad(lambda a: loss_of_params(merge(params, a, CONFIG)))(adapters)
    weight_grads = dict(nnx.to_flat_state(jax.grad(loss_of_params)(merge(params, adapters, CONFIG))))
    for name, path, split in [("0.q_proj", ("layers", 0, "attn", "q_weight_dnh"), 1),
                              ("1.o_proj", ("layers", 1, "attn", "o_weight_nhd"), 2),
                              ("1.down_proj", ("layers", 1, "mlp", "down_weight_fd"), 1)]:
        g = np.asarray(weight_grads[path][...])
        g = g.reshape(int(np.prod(g.shape[:split])), -1)
        a, b = np.asarray(adapters[name]["a"]), np.asarray(adapters[name]["b"])
        np.testing.assert_allclose(np.asarray(grads[name]["a"]), 2.0 * g @ b.T, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grads[name]["b"]), 2.0 * a.T @ g, rtol=1e-4, atol=1e-6)
        assert np.abs(np.asarray(grads[name]["b"])).max() > 1e-6


def test_a_saved_folder_is_peft_layout_and_transformers_agrees(base, tmp_path):
    folder, torch_model = base
    model = load_model(folder, dtype="float32")
    adapters = random_adapters(model)
    save_adapters(tmp_path / "adapter", adapters, CONFIG, base=str(folder))
    record = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (record["peft_type"], record["r"], record["lora_alpha"]) == ("LORA", 4, 8.0)
    ours = logits(load_folder(tmp_path / "adapter", dtype="float32"))
    np.testing.assert_allclose(ours, logits(merged_model(model, adapters, CONFIG)), atol=1e-5)

    from jaxopd.models.weights import SafetensorsFile
    tensors = SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors")
    state = {k: v.clone() for k, v in torch_model.state_dict().items()}
    for key in tensors.keys():
        if ".lora_A." in key:
            target = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            a = torch.from_numpy(np.array(tensors[key]))
            b = torch.from_numpy(np.array(tensors[key.replace(".lora_A.", ".lora_B.")]))
            state[target] += 2.0 * b @ a                                      # PEFT: W + scale · B A
    reference = type(torch_model)(torch_model.config).eval()
    reference.load_state_dict(state)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT]), use_cache=False).logits[0].float().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert np.abs(ours - logits(model)).max() > 1e-3                         # the adapters changed the logits


def test_an_adapter_over_a_cut_base(base, tmp_path):
    folder, _ = base
    student = cut_layers(load_model(folder, dtype="float32"), [1])
    adapters = random_adapters(student, seed=3)
    save_adapters(tmp_path / "student", adapters, CONFIG, base=str(folder), layers=[1])
    loaded_adapters, config, layers = load_adapters(tmp_path / "student")
    assert (config, layers, sorted(loaded_adapters)) == (CONFIG, [1], sorted(adapters))
    np.testing.assert_allclose(logits(load_folder(tmp_path / "student", dtype="float32")),
                               logits(merged_model(student, adapters, CONFIG)), atol=1e-5)


def test_bad_configs_and_folders_are_refused(base, tmp_path):
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="targets must be among"):
        LoraConfig(targets=("qkv",))
    folder, _ = base
    model = load_model(folder, dtype="float32")
    save_adapters(tmp_path / "a", random_adapters(model), CONFIG, base=str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="base model .* is not a folder"):
        load_folder(tmp_path / "a")
    save_adapters(tmp_path / "b", random_adapters(model), CONFIG, base=str(folder), layers=[0])
    with pytest.raises(CheckpointError, match="adapter for layer 1, the model has 1 layers"):
        load_folder(tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(CheckpointError, match="has no 'lora_alpha'"):
        load_folder(tmp_path / "c")


def test_an_adapter_folder_over_an_adapter_folder_carries_config_and_takes_the_bases_tokenizer(base, tmp_path):
    from jaxopd.models.folders import load_folder_tokenizer, tokenizer_folder
    from jaxopd.tokenizer import load_tokenizer

    folder, _ = base
    student = cut_layers(load_model(folder, dtype="float32"), [0])
    first = random_adapters(student, seed=4)
    save_adapted(tmp_path / "student", first, CONFIG, base=folder, model_config=student.config, layers=[0])
    merged_student = load_folder(tmp_path / "student", dtype="float32")
    second = random_adapters(merged_student, seed=6)
    save_adapted(tmp_path / "distilled", second, CONFIG, base=tmp_path / "student",
                 model_config=merged_student.config)
    assert json.loads((tmp_path / "distilled" / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((tmp_path / "distilled" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == "../student"
    np.testing.assert_allclose(logits(load_folder(tmp_path / "distilled", dtype="float32")),
                               logits(merged_model(merged_student, second, CONFIG)), atol=1e-5)
    assert tokenizer_folder(tmp_path / "distilled").resolve() == Path(folder).resolve()   # through the student
    assert load_folder_tokenizer(tmp_path / "distilled").vocab_size == load_tokenizer(None).vocab_size
    assert base_reference(folder) == str(folder)            # not a fetched catalogue model: a path


def test_adapters_on_some_layers_only(base, tmp_path):
    """``LoraConfig.layers``: adapters on those layers alone; the lower layers' weights stay the base's, and a loss
    of the merged model differentiates to zero only for adapters that exist; the folder records the layers as PEFT's
    ``layers_to_transform`` and loads them back."""
    folder, _ = base
    model = load_model(folder, dtype="float32")
    upper = LoraConfig(rank=4, alpha=8.0, layers=(1,))
    adapters = random_adapters(model, upper)
    assert sorted({name.split(".")[0] for name in adapters}) == ["1"] and len(adapters) == 7
    params = nnx.state(model, nnx.Param)
    merged = merge(params, adapters, upper)
    np.testing.assert_array_equal(np.asarray(merged["layers"][0]["attn"]["q_weight_dnh"][...]),
                                  np.asarray(params["layers"][0]["attn"]["q_weight_dnh"][...]))
    assert not np.allclose(np.asarray(merged["layers"][1]["attn"]["q_weight_dnh"][...]),
                           np.asarray(params["layers"][1]["attn"]["q_weight_dnh"][...]))
    save_adapters(tmp_path / "upper", adapters, upper, base=str(folder))
    record = json.loads((tmp_path / "upper" / "adapter_config.json").read_text())
    assert record["layers_to_transform"] == [1]
    loaded, config, _ = load_adapters(tmp_path / "upper")
    assert config == upper and sorted(loaded) == sorted(adapters)
    np.testing.assert_allclose(logits(load_folder(tmp_path / "upper")), logits(merged_model(model, adapters, upper)),
                               rtol=1e-5, atol=1e-5)


def test_bad_adapter_layers_are_refused(base):
    model = load_model(base[0], dtype="float32")
    for layers in ((), (1, 0), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="LoRA layers"):
            LoraConfig(rank=2, layers=layers)
    with pytest.raises(ValueError, match="the model has 2 layers"):
        init_adapters(nnx.state(model, nnx.Param), LoraConfig(rank=2, layers=(0, 2)), jax.random.key(0), num_layers=2)
