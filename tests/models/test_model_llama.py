"""Llama in NNX against transformers' PyTorch Llama: logits with padding, export back, refused configurations.

Tiny random Llamas made by transformers (``LlamaConfig`` / ``LlamaForCausalLM``, float32, ``save_pretrained``),
over GQA ratios 4/4, 6/2 and 8/1, tied and untied embeddings, RoPE bases 10,000 and 500,000, and one explicit
``head_dim`` that is not ``hidden / heads``. Nothing is downloaded.
"""
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxopd.models.weights import CheckpointError, SafetensorsFile, load_model, save_model

PROMPT_LENGTHS = (3, 11, 26, 40)
VOCAB = 384

# id: (hidden, heads, kv heads, head_dim given to LlamaConfig or None, tied, rope_theta)
SHAPES = {
    "mha-4x4-tied-10k": (64, 4, 4, None, True, 10_000.0),
    "gqa-6x2-untied-500k": (96, 6, 2, None, False, 500_000.0),
    "mqa-8x1-tied-500k": (64, 8, 1, None, True, 500_000.0),
    "head_dim32-4x2-untied-10k": (64, 4, 2, 32, False, 10_000.0),    # head_dim 32 != 64 / 4
}


def make_hf_llama(folder, *, hidden, heads, kv_heads, head_dim, tied, rope_theta, seed=0):
    """A random tiny Llama made by transformers and saved with save_pretrained (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = {} if head_dim is None else {"head_dim": head_dim}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **kwargs)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1: perturb them so a wrong norm mapping cannot pass
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def hf_llama(request, tmp_path_factory):
    """(folder, torch model, shape) of a random tiny Llama for each of SHAPES."""
    hidden, heads, kv_heads, head_dim, tied, theta = SHAPES[request.param]
    folder = tmp_path_factory.mktemp(f"llama_{request.param}")
    model = make_hf_llama(folder, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, tied=tied,
                          rope_theta=theta)
    return folder, model, SHAPES[request.param]


def _prompts(seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _batch(prompts, padding_side):
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(tokens, dtype=bool)
    positions = np.zeros_like(tokens)
    for b, ids in enumerate(prompts):
        start = 0 if padding_side == "right" else width - len(ids)
        tokens[b, start:start + len(ids)] = ids
        mask[b, start:start + len(ids)] = True
        positions[b, start:start + len(ids)] = np.arange(len(ids))
    return tokens, positions, mask


def test_config_is_read_as_llama(hf_llama):
    folder, torch_model, (hidden, heads, kv_heads, head_dim, tied, theta) = hf_llama
    cfg = load_model(folder, dtype="float32").config
    assert (cfg.model_type, cfg.qk_norm) == ("llama", False)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (hidden, heads, kv_heads,
                                                                                          tied)
    assert cfg.head_dim == (head_dim or hidden // heads)
    assert cfg.rope_theta == theta and cfg.rms_norm_eps == 1e-5
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.end_token_ids) == (1, 2, (2,))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_logits_match_transformers_with_padding(hf_llama, padding_side):
    folder, torch_model, _ = hf_llama
    model = load_model(folder, dtype="float32")
    prompts = _prompts()
    tokens, positions, mask = _batch(prompts, padding_side)
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    assert logits.dtype == np.float32
    for b, ids in enumerate(prompts):
        ours = logits[b][mask[b]]
        ref = _torch_logits(torch_model, ids)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        assert np.abs(ref).max() > 0.1  # the comparison is not between near-zero tensors


def test_export_back_to_transformers(hf_llama, tmp_path):
    from transformers import LlamaForCausalLM

    folder, torch_model, (_, _, _, _, tied, _) = hf_llama
    model = load_model(folder, dtype="float32")
    save_model(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    names = SafetensorsFile(tmp_path / "export" / "model.safetensors").keys()
    assert not [n for n in names if "q_norm" in n or "k_norm" in n]
    assert ("lm_head.weight" in names) == (not tied)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True).eval()
    assert reloaded.config.model_type == "llama"
    assert reloaded.config.tie_word_embeddings == tied
    ref_sd, new_sd = torch_model.state_dict(), reloaded.state_dict()
    assert set(ref_sd) == set(new_sd)
    for ids in _prompts(seed=3):
        np.testing.assert_allclose(_torch_logits(reloaded, ids), _torch_logits(torch_model, ids), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_refusals")
    make_hf_llama(folder, hidden=64, heads=4, kv_heads=2, head_dim=None, tied=True, rope_theta=10_000.0)
    return folder


@pytest.mark.parametrize("edit,message", [
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}},
     r"rope_scaling of rope_type 'llama3' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     r"rope_parameters of rope_type 'llama3' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
     r"not a Qwen3 or Llama checkpoint: model_type='mistral'"),
], ids=["attention_bias", "mlp_bias", "rope_scaling-llama3", "rope_parameters-llama3", "hidden_act", "mistral"])
def test_refused_configurations_name_the_field(llama_folder, tmp_path, edit, message):
    dst = tmp_path / "ckpt"
    shutil.copytree(llama_folder, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(edit)
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(dst)
