"""Llama in NNX against transformers' PyTorch Llama: logits with padding, export back, refused configurations.

Tiny random Llamas made by transformers (``LlamaConfig`` / ``LlamaForCausalLM``, float32, ``save_pretrained``),
over GQA ratios 4/4, 6/2 and 8/1, tied and untied embeddings, RoPE bases 10,000 and 500,000, and one explicit
``head_dim`` that is not ``hidden / heads``. Nothing is downloaded.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from jaxopd.models.weights import CheckpointError, SafetensorsFile, load_model, save_model
from micro_models import assert_padded_logits_match, perturb_norms, torch_logits

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
    model = perturb_norms(LlamaForCausalLM(cfg).eval())
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
    assert_padded_logits_match(model, torch_model, _prompts(), padding_side)


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
        np.testing.assert_allclose(torch_logits(reloaded, ids), torch_logits(torch_model, ids), atol=1e-5, rtol=0)


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
