"""GGUF import (jaxopd.models.gguf) against transformers' own GGUF loader, on synthetic files; the command line's
refusals of bad input.

Every GGUF here is written by ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama:
llama.* metadata, tensor names ``token_embd`` / ``blk.N.attn_q`` / ..., query and key rows permuted by
``LlamaModel.permute`` (re-implemented below from its definition), 1-D norms in F32 and the 2-D weights in one
tensor type. The tokenizer is a byte-level BPE trained here (the 256 GPT-2 byte characters, 40 merges learned
with digits split one by one, as SmolLM's were) with ChatML special tokens and template. Nothing is downloaded.

``gguf.quants.quantize`` cannot quantise the K types (Q4_K, Q6_K raise NotImplementedError in gguf 0.19), so
those tensors are random but well-formed blocks (finite scales patched in): both importers dequantise the same
blocks with ``gguf.quants.dequantize``, so the comparison checks the layout, the tensor map and the
un-permutation, not the dequantiser. The real SmolLM2 file holds only Q4_1, Q8_0 and F32 tensors
(tests/models/test_pretrained_smollm2.py).
"""
import functools
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from conftest import llama_cpp_smollm_ids  # noqa: E402
from jaxopd.models.gguf import (GGUFError, gguf_to_hf_folder, hf_tokenizer_files, open_gguf,  # noqa: E402
                                unpermute_qk)
from jaxopd.models.weights import SafetensorsFile, load_model  # noqa: E402
from jaxopd.tokenizer import load_tokenizer  # noqa: E402
from micro_models import perturb_norms, torch_logits  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# SmolLM2-Instruct's template (ChatML with a default system message)
CHAT_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["You arrive at countertop 1. On the countertop 1, you see a apple 2, and a knife 1.",
          "> go to fridge 1", "You open the fridge 1. The fridge 1 is open. In it, you see a egg 3.",
          "Your task is to: put a clean apple in the fridge.", "Nothing happens.",
          "You pick up the apple 2 from the countertop 1."] * 3
TEXTS = [
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, and a knife 1.\n> go to fridge 1",
    "Your task is to: put a clean apple in fridge.\n\nAVAILABLE ACTIONS: go to cabinet 12, take egg 3 from "
    "sinkbasin 1",
    "Ünïcödé: naïve café, Größe, 東京タワー, Привет мир, ¿qué?",
    "emoji 🍎🔪 and 👩‍👩‍👧 and 🏳️‍🌈!",
    "whitespace   runs\t\ttabs\n\n\n  indented\r\n    end   ",
    "digits 0123456789 2024 3.14159 -42 1,000,000",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    " leading space", "",
]
CHAT = [{"role": "system", "content": "You are an agent in a household. Answer with one action."},
        {"role": "user", "content": "You arrive at countertop 1. On the countertop 1, you see a apple 2."},
        {"role": "assistant", "content": "take apple 2 from countertop 1"},
        {"role": "user", "content": "You pick up the apple 2 from the countertop 1.\n> go to fridge 1 🍎"}]

# the synthetic Llama: every 2-D weight's rows are a multiple of 256 values (the K types' block)
LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100_000.0)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
CRAFTED_TYPES = {"Q4_K": (0, 2, 2e-4), "Q6_K": (208, 0, 1e-5)}   # byte offsets of d (and dmin), scale of d
PROMPT_LENGTHS = (1, 6, 29, 90)

_GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                     "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}


# ---------------------------------------------------------------------------------------------- writing GGUFs
def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): Hugging Face's rotate-half rows of each head
    regrouped into interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, *module, _ = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(module)]}.weight"


@functools.lru_cache(maxsize=None)
def byte_level_bpe() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens by id, merges "a b") of a byte-level BPE: the 3 specials, the 256 byte characters, 40 merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + 256 + 40, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    assert sorted(vocab.values()) == list(range(len(vocab))) and len(vocab) == len(SPECIALS) + 256 + 40
    merges = tuple(" ".join(m) if isinstance(m, list) else m for m in model["merges"])
    assert len(merges) == 40 and not any(c.isdigit() for m in merges for c in m)
    return tuple(sorted(vocab, key=vocab.get)), merges


def add_tokenizer(writer, *, model="gpt2", pre="smollm", tokens=None, merges=None):
    default_tokens, default_merges = byte_level_bpe()
    tokens = list(tokens or default_tokens)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(list(merges or default_merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def encode_tensor(w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, QT | None]:
    """A 2-D float weight as GGUF tensor data of type ``kind`` (and the raw type to declare)."""
    if kind == "F32":
        return np.ascontiguousarray(w, np.float32), None
    if kind == "F16":
        return np.ascontiguousarray(w.astype(np.float16)), None
    qtype = QT[kind]
    if kind in CRAFTED_TYPES:                 # gguf.quants cannot quantise these: well-formed random blocks
        d_at, dmin_at, scale = CRAFTED_TYPES[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for at in {d_at, dmin_at}:
            blocks[..., at:at + 2] = (scale * rng.uniform(0.5, 1.0, blocks.shape[:2])).astype(np.float16)[
                ..., None].view(np.uint8)
        return blocks.reshape(w.shape[0], -1), qtype
    return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype), qtype


def write_gguf(path, weights: dict[str, np.ndarray], *, arch="llama", kind="F32", heads=4, kv_heads=2,
               hidden=256, ffn=512, head_dim=None, rope_theta=100_000.0, eps=1e-5, tokenizer=None,
               drop_tensors=(), raw_tensor=None, seed=0) -> str:
    """``weights`` (Hugging Face names, float) as a GGUF file the way llama.cpp converts them."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    layers = 1 + max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
    writer.add_name("synthetic")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(eps)
    if arch == "qwen3":       # convert_hf_to_gguf writes key/value lengths for Qwen3 (head_dim is its own field)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_vocab_size(weights["model.embed_tokens.weight"].shape[0])
        writer.add_rope_dimension_count(head_dim or hidden // heads)
    writer.add_file_type(0)
    add_tokenizer(writer, **(tokenizer or {}))
    for name, w in weights.items():
        if name in drop_tensors:
            continue
        w = np.asarray(w, np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
        else:
            data, raw = encode_tensor(w, kind, rng)
            writer.add_tensor(gguf_name(name), data, raw_dtype=raw)
    if raw_tensor is not None:       # (name, uint8 bytes [rows, bytes per row], type)
        writer.add_tensor(raw_tensor[0], raw_tensor[1], raw_dtype=raw_tensor[2])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def llama_weights():
    """The float weights (Hugging Face names, numpy) of a random tiny untied Llama over the synthetic vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    params = dict(LLAMA)
    theta = params.pop("rope_theta")
    cfg = LlamaConfig(**params, vocab_size=len(byte_level_bpe()[0]), tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": theta}, bos_token_id=1, eos_token_id=2)
    model = perturb_norms(LlamaForCausalLM(cfg).eval())
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def import_kind(llama_weights, tmp_path_factory):
    """kind → (kind, folder holding the GGUF, GGUF file name, our imported folder), written once per kind."""
    done = {}

    def get(kind):
        if kind not in done:
            root = tmp_path_factory.mktemp(f"gguf_{kind}")
            write_gguf(root / f"tiny-{kind}.gguf", llama_weights, kind=kind)
            folder = gguf_to_hf_folder(root / f"tiny-{kind}.gguf", root / "hf")
            done[kind] = kind, root, f"tiny-{kind}.gguf", folder
        return done[kind]
    return get


@pytest.fixture(scope="module", params=TENSOR_TYPES)
def imported(request, import_kind):
    """(kind, folder holding the GGUF, GGUF file name, our imported folder) for each tensor type."""
    return import_kind(request.param)


def _prompts(vocab: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def _our_logits(model, prompts):
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(tokens, dtype=bool)
    for b, ids in enumerate(prompts):
        tokens[b, :len(ids)] = ids
        mask[b, :len(ids)] = True
    logits = np.asarray(model(jnp.asarray(tokens), None, jnp.asarray(mask)))
    return [logits[b, :len(ids)] for b, ids in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------- (a) logits
def test_logits_match_transformers_gguf_loader(imported):
    """Our import and transformers' GGUF loader agree on the logits, for every tensor type."""
    from transformers import AutoModelForCausalLM

    kind, root, name, folder = imported
    model = load_model(folder, dtype="float32")
    assert (model.config.model_type, model.config.num_kv_heads, model.config.tie_word_embeddings) == ("llama", 2,
                                                                                                      False)
    ref = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32).eval()
    assert type(ref).__name__ == "LlamaForCausalLM"
    prompts = _prompts(model.config.vocab_size)
    for ids, ours in zip(prompts, _our_logits(model, prompts)):
        expected = torch_logits(ref, ids)
        np.testing.assert_allclose(ours, expected, atol=1e-3, rtol=0, err_msg=f"{kind}, {len(ids)} tokens")
        assert np.abs(expected).max() > 0.1


# ---------------------------------------------------------------------------------------------- (b) weights
@pytest.mark.parametrize("rows,cols,heads", [(256, 8, 4), (128, 8, 2), (576, 3, 9), (192, 5, 3), (64, 1, 1)])
def test_unpermute_qk_inverts_llama_cpp_permute(rows, cols, heads):
    w = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
    permuted = permute(w, heads)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, heads), w)
    assert np.array_equal(unpermute_qk(permute(w[:, 0], heads), heads), w[:, 0])   # 1-D (a bias) too


def test_unpermute_qk_refuses_odd_heads():
    with pytest.raises(GGUFError, match="cannot hold 3 heads of even size"):
        unpermute_qk(np.zeros((9, 4), np.float32), 3)


# how far a dequantised weight may be from the float original, relative to its largest magnitude
_TOLERANCE = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q5_0": 7e-2, "Q5_1": 7e-2, "Q4_0": 0.15, "Q4_1": 0.15}


def test_imported_weights_against_the_float_originals(imported, llama_weights):
    """F32 round-trips exactly; F16/BF16 are the rounded originals exactly; the quantised types stay within their
    step size of the originals (a wrong row permutation would not)."""
    kind, _, _, folder = imported
    st = SafetensorsFile(folder / "model.safetensors")
    assert set(st.keys()) == set(llama_weights)
    for name, original in llama_weights.items():
        got = np.asarray(st[name])
        assert got.dtype == np.float32 and got.shape == original.shape, name
        if kind == "F32" or original.ndim == 1:
            assert np.array_equal(got, original), name
        elif kind == "F16":
            assert np.array_equal(got, original.astype(np.float16).astype(np.float32)), name
        elif kind == "BF16":
            import ml_dtypes
            assert np.array_equal(got, original.astype(ml_dtypes.bfloat16).astype(np.float32)), name
        if kind in _TOLERANCE and original.ndim == 2:
            err = np.abs(got - original).max()
            assert err <= _TOLERANCE[kind] * np.abs(original).max(), (name, err)
            wrong = unpermute_qk(got, 4) if "q_proj" in name else None    # the check can tell a wrong order
            if wrong is not None:
                assert np.abs(wrong - original).max() > 3 * err


def test_config_of_the_imported_folder(import_kind):
    _, _, _, folder = import_kind("F32")
    config = json.loads((folder / "config.json").read_text())
    assert config == {**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                      "intermediate_size": 512, "vocab_size": 299, "rope_theta": 100_000.0, "rms_norm_eps": 1e-5,
                      "tie_word_embeddings": False, "max_position_embeddings": 2048, "bos_token_id": 1,
                      "eos_token_id": 2}
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]


def test_tied_embedding_gguf(llama_weights, tmp_path):
    """A GGUF without output.weight is a tied model (the SmolLM2 file is one)."""
    from transformers import AutoModelForCausalLM

    weights = {k: v for k, v in llama_weights.items() if k != "lm_head.weight"}
    write_gguf(tmp_path / "tied.gguf", weights, kind="Q8_0")
    folder = gguf_to_hf_folder(tmp_path / "tied.gguf", tmp_path / "hf")
    model = load_model(folder, dtype="float32")
    assert model.config.tie_word_embeddings
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tied.gguf", dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)
    for ids, ours in zip(prompts, _our_logits(model, prompts)):
        np.testing.assert_allclose(ours, torch_logits(ref, ids), atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------------------------- (c) tokenizer
@pytest.fixture(scope="module")
def tokenizers_pair(import_kind):
    """(ours, transformers') tokenizers of the F32 file (the tokenizer does not depend on the tensor type)."""
    from transformers import AutoTokenizer

    _, root, name, folder = import_kind("F32")
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(root, gguf_file=name)


def test_tokenizer_ids_match_transformers(tokenizers_pair):
    ours, ref = tokenizers_pair
    assert ours.vocab_size == len(ref) == 299
    assert ours.eos_token_id == 2
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ids == llama_cpp_smollm_ids(text, ref, {s: i for i, s in enumerate(SPECIALS)}), text
        assert ours.decode(ids) == text
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    merged = ours.encode(TEXTS[0])
    assert len(merged) < len(TEXTS[0].encode())       # the merges are used


def test_chat_rendering_matches_transformers(tokenizers_pair):
    ours, ref = tokenizers_pair
    text = ours.apply_chat_template(CHAT, add_generation_prompt=True)
    assert text == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are an agent") and text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True) == ref.encode(
        text, add_special_tokens=False)
    no_system = ours.apply_chat_template(CHAT[1:2], add_generation_prompt=False)
    assert no_system == ref.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=False)
    assert "named SmolLM" in no_system


def test_smollm_pretokenizer_splits_every_digit(tmp_path):
    """tokenizer.ggml.pre 'smollm' is llama.cpp's regex pair (``\\p{N}`` first, then GPT-2's): even a vocabulary
    with a merge of two digits splits them, where 'gpt2' merges them. (transformers' GGUF tokenizer has no 'smollm'
    entry and uses GPT-2's regex alone; the real SmolLM2 vocabulary has no digit merges, so both agree on it.)"""
    from tokenizers import Tokenizer

    tokens, merges = byte_level_bpe()
    pieces = {}
    for pre in ("smollm", "gpt2"):
        path = tmp_path / f"{pre}.gguf"
        writer = gguf.GGUFWriter(str(path), arch="llama")
        add_tokenizer(writer, tokens=tokens + ("12",), merges=merges + ("1 2",), pre=pre)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tok = Tokenizer.from_str(hf_tokenizer_files(open_gguf(path))["tokenizer.json"])
        pieces[pre] = tok.encode("a 12", add_special_tokens=False).tokens
    assert pieces == {"smollm": ["a", "Ġ", "1", "2"], "gpt2": ["a", "Ġ", "12"]}


# ---------------------------------------------------------------------------------------------- (d) Qwen3
def test_qwen3_gguf_matches_transformers_qwen3(tmp_path):
    """A Qwen3 GGUF (q/k norms, no permutation, key_length 32 != hidden / heads) imports to the same logits as the
    transformers Qwen3 whose float weights it holds."""
    from conftest import make_hf_qwen3

    vocab = len(byte_level_bpe()[0])
    torch_model = make_hf_qwen3(tmp_path / "hf_qwen3", tied=True, vocab_size=vocab, head_dim=32).eval()
    weights = {k: v.detach().numpy().copy() for k, v in torch_model.state_dict().items() if k != "lm_head.weight"}
    assert any("q_norm" in k for k in weights)
    write_gguf(tmp_path / "qwen3.gguf", weights, arch="qwen3", heads=4, kv_heads=2, hidden=64, ffn=128, head_dim=32,
               rope_theta=1_000_000.0, eps=1e-6, tokenizer={"pre": "qwen2"})
    folder = gguf_to_hf_folder(tmp_path / "qwen3.gguf", tmp_path / "imported")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["vocab_size"], config["rms_norm_eps"],
            config["tie_word_embeddings"]) == ("qwen3", 32, vocab, 1e-6, True)
    model = load_model(folder, dtype="float32")
    assert model.config.qk_norm
    prompts = _prompts(vocab, seed=9)
    for ids, ours in zip(prompts, _our_logits(model, prompts)):
        expected = torch_logits(torch_model, ids)
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
        assert np.abs(expected).max() > 0.1
    st = SafetensorsFile(folder / "model.safetensors")
    for name, w in weights.items():
        assert np.array_equal(np.asarray(st[name]), w), name
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(tmp_path, gguf_file="qwen3.gguf")
    for text in TEXTS:      # tokenizer.ggml.pre 'qwen2': Qwen2's split regex
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text


# ---------------------------------------------------------------------------------------------- (e) command line
@pytest.fixture(scope="module")
def small_weights():
    """Float weights of a one-layer Llama of hidden 64 (for the command-line cases, which never read them)."""
    rng = np.random.default_rng(0)
    vocab = len(byte_level_bpe()[0])
    shapes = {"model.embed_tokens.weight": (vocab, 64), "model.norm.weight": (64,),
              "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.up_proj.weight": (128, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 128)}
    return {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _write_small(path, weights, **kwargs):
    return write_gguf(path, weights, hidden=64, ffn=128, heads=4, kv_heads=2, **kwargs)


def _fetch_main(argv, capsys):
    from jaxopd_experiments.fetch_model import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _bad_inputs(tmp_path, weights):
    """name → (argv after --gguf, the --out folder, a regex the error line must match)."""
    good = _write_small(tmp_path / "good.gguf", weights)
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF" * 10)
    gemma = _write_small(tmp_path / "gemma.gguf", weights, arch="gemma")
    truncated = tmp_path / "truncated.gguf"
    data = open(good, "rb").read()
    truncated.write_bytes(data[:len(data) // 2])
    iq = _write_small(tmp_path / "iq4.gguf", weights, drop_tensors=("model.layers.0.mlp.up_proj.weight",),
                      raw_tensor=("blk.0.ffn_up.weight", np.zeros((128, 64 // 32 * 18), np.uint8), QT.IQ4_NL))
    spm = _write_small(tmp_path / "spm.gguf", weights, tokenizer={"model": "llama"})
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    out = tmp_path / "out"
    return {
        "missing file": ([tmp_path / "nope.gguf"], out, r"GGUF file '.*nope.gguf' does not exist"),
        "not GGUF": ([not_gguf], out, r"is not a GGUF file \(it starts with b'PK\\x03\\x04'"),
        "gemma": ([gemma], out, r"general.architecture 'gemma' is not supported"),
        "truncated": ([truncated], out, r"truncated.gguf' is cut off"),
        "IQ4_NL tensor": ([iq], out, r"tensor 'blk.0.ffn_up.weight' has GGUF type IQ4_NL, which this port does not"),
        "sentencepiece": ([spm], out, r"tokenizer.ggml.model 'llama' is not supported"),
        "out is a file": ([good], a_file, r"--out '.*a_file' exists and is not a folder"),
        "out under a file": ([good], a_file / "model", r"--out '.*a_file/model' is not writable"),
    }


def test_command_line_refuses_bad_input(tmp_path, small_weights, capsys):
    """Every bad input: exit code 2, one line "error: ..." naming the problem, nothing written anywhere."""
    cases = _bad_inputs(tmp_path, small_weights)
    before = sorted(p.name for p in tmp_path.iterdir())
    for name, (gguf_args, out, pattern) in cases.items():
        code, stdout, stderr = _fetch_main(["--gguf", *gguf_args, "--out", out], capsys)
        assert code == 2, (name, stdout, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, stderr)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert stdout == "", name
        assert not (tmp_path / "out").exists(), name
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name     # no temporary folder left behind
        assert (tmp_path / "a_file").read_text() == "not a folder"


def test_command_line_usage_errors(capsys, tmp_path):
    for argv, pattern in (([], "give a model name or --gguf FILE"), (["--gguf", tmp_path / "x.gguf"],
                                                                     "--gguf needs --out DIR")):
        code, _, stderr = _fetch_main(argv, capsys)
        assert code == 2 and stderr.count("\n") == 1 and pattern in stderr, stderr


def test_read_only_parent(tmp_path, small_weights, capsys):
    """--out under a folder this user may not write (as root, os.access allows everything: skipped then; the
    'out under a file' case of test_command_line_refuses_bad_input covers the refusal)."""
    good = _write_small(tmp_path / "good.gguf", small_weights)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: a 0o500 folder is still writable")
        code, _, stderr = _fetch_main(["--gguf", good, "--out", locked / "model"], capsys)
        assert code == 2 and stderr.startswith("error: ") and "is not writable" in stderr
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_out_not_empty_needs_force(tmp_path, small_weights, capsys):
    good = _write_small(tmp_path / "good.gguf", small_weights)
    gemma = _write_small(tmp_path / "gemma.gguf", small_weights, arch="gemma")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, stderr = _fetch_main(["--gguf", good, "--out", out], capsys)
    assert code == 2 and stderr.count("\n") == 1 and "is not empty (pass --force to replace it)" in stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --force with a bad file: refused, and what --out held is kept
    code, _, stderr = _fetch_main(["--gguf", gemma, "--out", out, "--force"], capsys)
    assert code == 2 and "gemma" in stderr and [p.name for p in out.iterdir()] == ["keep.txt"]
    code, stdout, stderr = _fetch_main(["--gguf", good, "--out", out, "--force"], capsys)
    assert code == 0 and stderr == "" and stdout.startswith(str(out))
    assert not (out / "keep.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "fetch.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf", "good.gguf", "out"]
    record = json.loads((out / "fetch.json").read_text())
    assert record["source"] == str((tmp_path / "good.gguf").resolve()) and len(record["gguf_sha256"]) == 64
    assert load_model(out, dtype="float32").config.num_layers == 1


def test_command_line_subprocess(tmp_path):
    """The module run as a program: the same one line and exit code 2."""
    env = {**os.environ, "JAXOPD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "experiments.fetch_model", "--gguf", str(tmp_path / "nope.gguf"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: GGUF file {str(tmp_path / 'nope.gguf')!r} does not exist"]
    assert not (tmp_path / "out").exists()
