"""Qwen3 in NNX against transformers' PyTorch Qwen3: logits, greedy decoding, weight round trip, errors."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxopd.models.decoder import PRESETS, ModelConfig, abstract_model, count_params
from micro_models import assert_padded_logits_match
from jaxopd.models.weights import (CheckpointError, SafetensorsFile, check_checkpoint_files, load_model, read_config,
                                   save_model, write_safetensors)

PROMPT_LENGTHS = (5, 17, 33, 64)


def _prompts(vocab: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_logits_match_transformers_with_padding(hf_qwen3, padding_side):
    folder, torch_model = hf_qwen3
    model = load_model(folder, dtype="float32")
    assert_padded_logits_match(model, torch_model, _prompts(model.config.vocab_size), padding_side)


def test_greedy_continuation_matches_transformers(hf_qwen3):
    folder, torch_model = hf_qwen3
    model = load_model(folder, dtype="float32")
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, tokens, length):
        logits = nnx.merge(graphdef, state)(tokens)
        return jnp.argmax(logits[0, length - 1])

    for ids in _prompts(model.config.vocab_size, seed=7)[:3]:
        with torch.no_grad():
            ref = torch_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       pad_token_id=0)[0, len(ids):].tolist()
        buf = np.zeros((1, len(ids) + 32), np.int32)  # fixed width: one compilation
        buf[0, :len(ids)] = ids
        out = []
        for step in range(32):
            tok = int(next_token(state, jnp.asarray(buf), len(ids) + step))
            buf[0, len(ids) + step] = tok
            out.append(tok)
        assert out == ref


def test_export_round_trip_is_exact(hf_qwen3, tmp_path):
    from transformers import Qwen3ForCausalLM

    folder, torch_model = hf_qwen3
    model = load_model(folder, dtype="float32")
    save_model(model, tmp_path / "export")
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True)
    ref_sd, new_sd = torch_model.state_dict(), reloaded.state_dict()
    assert set(ref_sd) == set(new_sd)
    for name in ref_sd:
        assert torch.equal(ref_sd[name], new_sd[name]), name
    assert reloaded.config.tie_word_embeddings == torch_model.config.tie_word_embeddings


def test_sharded_export_and_load(hf_qwen3, tmp_path):
    folder, _ = hf_qwen3
    model = load_model(folder, dtype="float32")
    save_model(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = load_model(tmp_path / "sharded", dtype="float32")
    a, b = nnx.state(model, nnx.Param), nnx.state(again, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_load_directly_into_a_sharding(hf_qwen3):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    folder, _ = hf_qwen3
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices.reshape(2, 2), ("data", "model"))

    def sharding(path, shape):
        if len(shape) >= 2 and shape[0] % 2 == 0 and shape[1] % 2 == 0:
            return NamedSharding(mesh, P("data", "model"))
        return NamedSharding(mesh, P())

    sharded = load_model(folder, dtype="float32", sharding=sharding)
    plain = load_model(folder, dtype="float32")
    emb = sharded.embedding_vd[...]
    assert emb.sharding.spec == P("data", "model")
    assert emb.addressable_shards[0].data.shape == (emb.shape[0] // 2, emb.shape[1] // 2)
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(plain.embedding_vd[...]))
    q = sharded.layers[1].attn.q_weight_dnh[...]
    np.testing.assert_array_equal(np.asarray(q), np.asarray(plain.layers[1].attn.q_weight_dnh[...]))


def test_bfloat16_checkpoint_loads(tmp_path, hf_qwen3):
    folder, _ = hf_qwen3
    model = load_model(folder, dtype="bfloat16")
    assert model.embedding_vd[...].dtype == jnp.bfloat16
    save_model(model, tmp_path / "bf16")
    st = SafetensorsFile(tmp_path / "bf16" / "model.safetensors")
    assert st["model.embed_tokens.weight"].dtype == np.dtype(jnp.bfloat16)
    again = load_model(tmp_path / "bf16", dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(again.embedding_vd[...]), np.asarray(model.embedding_vd[...]))
    logits = again(jnp.array([[1, 2, 3]]))
    assert logits.dtype == jnp.float32


# ---------------------------------------------------------------------------------------------- errors
def _copy(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def _rewrite_tensors(folder, edit):
    st = SafetensorsFile(folder / "model.safetensors")
    tensors = {k: np.array(st[k]) for k in st.keys()}
    del st
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def test_error_cut_off_safetensors(hf_qwen3, tmp_path):
    """A checkpoint whose writing was cut off is named as such, by the loader and by the header-only check."""
    dst = _copy(hf_qwen3[0], tmp_path)
    assert check_checkpoint_files(dst) == read_config(dst)
    data = (dst / "model.safetensors").read_bytes()
    for cut, message in ((len(data) - 1, r"is cut off: its header needs [\d,]+ bytes, the file has [\d,]+"),
                         (100, r"is not a readable safetensors file \(100 bytes\): its header is said to take"),
                         (5, r"is cut off: 5 bytes, shorter than a safetensors header")):
        (dst / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=message):
            check_checkpoint_files(dst)
        with pytest.raises(CheckpointError, match=message):
            load_model(dst)
    (dst / "model.safetensors").write_bytes(data)
    (dst / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        check_checkpoint_files(dst)


def test_error_folder_missing(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_error_no_safetensors(hf_qwen3, tmp_path):
    dst = _copy(hf_qwen3[0], tmp_path)
    (dst / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors files"):
        load_model(dst)


def test_error_not_qwen3(hf_qwen3, tmp_path):
    dst = _copy(hf_qwen3[0], tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a Qwen3 or Llama checkpoint: model_type='mistral'"):
        load_model(dst)
    # a Qwen3 folder relabelled Llama: its q/k norms are tensors no Llama model has
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unexpected tensor.*q_norm.*not part of a llama model"):
        load_model(dst)


def test_error_missing_tensor(hf_qwen3, tmp_path):
    dst = _copy(hf_qwen3[0], tmp_path)
    _rewrite_tensors(dst, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(dst)


def test_error_extra_tensor(hf_qwen3, tmp_path):
    dst = _copy(hf_qwen3[0], tmp_path)
    _rewrite_tensors(dst, lambda t: t.__setitem__("model.layers.7.mlp.up_proj.weight", np.zeros((2, 2), np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['model.layers.7.mlp.up_proj.weight'\]"):
        load_model(dst)


def test_error_shape_mismatch(hf_qwen3, tmp_path):
    dst = _copy(hf_qwen3[0], tmp_path)
    _rewrite_tensors(dst, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                                  np.zeros((16, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape "
                                              r"\(16, 64\), expected \(32, 64\)"):
        load_model(dst)


# ---------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name,expected,tolerance", [
    ("qwen3-0.6b", 0.60e9, 0.01e9), ("qwen3-1.7b", 1.72e9, 0.01e9),
    ("qwen3-4b", 4.02e9, 0.01e9), ("qwen3-8b", 8.19e9, 0.01e9)])
def test_full_presets_build_abstractly_with_published_sizes(name, expected, tolerance):
    cfg = ModelConfig.preset(name)
    n = count_params(nnx.state(abstract_model(cfg), nnx.Param))
    assert abs(n - expected) <= tolerance, (name, n)


def test_preset_exact_counts():
    counts = {name: count_params(nnx.state(abstract_model(PRESETS[name]), nnx.Param)) for name in PRESETS}
    assert counts == {"qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096,
                      "qwen3-8b": 8_190_735_360, "tiny": 42_044_160, "smollm2-135m": 134_515_008}


def test_config_validation():
    with pytest.raises(ValueError, match="unknown model preset 'qwen3-3b'"):
        ModelConfig.preset("qwen3-3b")
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"):
        ModelConfig(hidden_size=64, num_layers=1, num_heads=6, num_kv_heads=4, head_dim=16, intermediate_size=32)
    with pytest.raises(ValueError, match="tokens must be \\[batch, time\\]"):
        from jaxopd.models.decoder import CausalLM
        CausalLM(PRESETS["tiny"].with_dtypes("float32"), rngs=nnx.Rngs(0))(jnp.zeros((3,), jnp.int32))
