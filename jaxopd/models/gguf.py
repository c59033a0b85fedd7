"""llama.cpp GGUF files (Llama, Qwen3) into Hugging Face folders that ``load_model`` and ``load_tokenizer`` read.

Owns the GGUF side of the weight port: the metadata → ``config.json`` map, the tensor-name map, undoing the
query/key row permutation that llama.cpp's converter applies to Llama weights, dequantisation to float32 by the
``gguf`` package (llama.cpp's own reader and dequantiser: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the
rest it knows), and the byte-level BPE tokenizer (vocabulary, merges, special tokens, chat template) rebuilt as
``tokenizer.json`` / ``tokenizer_config.json``. A folder is written under a temporary name and renamed into
place when complete, so a failure never leaves half a model behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from jaxopd.models.weights import write_safetensors

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
# GGUF tensor types small models ship in, all dequantised by gguf.quants (a type outside this set is refused)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                          "Q5_K", "Q6_K", "Q8_K")
# tokenizer.ggml.pre → the pre-tokenizer of the Hugging Face tokenizer it was converted from
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "gpt2", "default", "llama3", "llama-bpe", "qwen2")

_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file that cannot become a model folder (the message names the file, field or tensor)."""


def check_writable(out: str | os.PathLike) -> None:
    """``GGUFError`` unless ``out`` could be created (or replaced) as a folder; creates nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GGUFError(f"--out {str(out)!r} exists and is not a folder")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise GGUFError(f"--out {str(out)!r} is not writable ({str(ancestor)!r} does not allow it)")


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------
def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``path``; ``GGUFError`` for a missing, foreign or truncated file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
        for tensor in reader.tensors:           # a cut-off file reads its header but not every tensor
            end = tensor.data_offset + tensor.n_bytes
            if end > len(reader.data):
                raise GGUFError(f"{str(path)!r} is cut off: tensor {tensor.name!r} ends at byte {end:,}, the file "
                                f"has {len(reader.data):,}")
    except GGUFError:
        raise
    except Exception as e:      # the reader's own errors (struct, memmap, reshape) on a cut-off or damaged file
        raise GGUFError(f"{str(path)!r} is cut off or damaged: the GGUF reader fails on its {path.stat().st_size:,} "
                        f"bytes ({type(e).__name__}: {e})") from None
    return reader


def _field(reader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"the GGUF file has no {key!r} field")
        return default
    return field.contents()


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------
def hf_config(reader) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the model in a GGUF file (``GGUFError`` on what this port cannot do)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"general.architecture {arch!r} is not supported; choose a GGUF of "
                        f"{list(SUPPORTED_ARCHITECTURES)}")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None, ""):
        raise GGUFError(f"{arch}.rope.scaling.type {scaling!r} is not supported (only default RoPE)")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens", None)
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if not vocab:
        raise GGUFError("the GGUF file names no vocabulary size (no llama.vocab_size, no tokenizer.ggml.tokens)")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.rope.dimension_count",
                                                                          hidden // heads)))
    names = {t.name for t in reader.tensors}
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id", None), _field(reader, "tokenizer.ggml.eos_token_id", None)
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "vocab_size": vocab,
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10_000.0 if arch == "llama" else 1_000_000.0)),
        "rms_norm_eps": float(np.float32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))),
        "tie_word_embeddings": "output.weight" not in names,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config.update({"mlp_bias": False, "pretraining_tp": 1, "rope_scaling": None})
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos is not None:
        config["eos_token_id"] = int(eos)
    # float32 rounding of the stored epsilon (1e-5 is stored as 9.99999974e-06): write the decimal it came from
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.6g}")
    return config


# ----------------------------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------------------------
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``),
    or None for tensors a Hugging Face model does not store (``rope_freqs.weight``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    if gguf_name in ("rope_freqs.weight",):
        return None
    raise GGUFError(f"GGUF tensor {gguf_name!r} is not part of a Llama/Qwen3 model this port knows")


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``LlamaModel.permute`` of q/k projection rows ``[heads * head_dim, in]``.

    The converter regroups each head's rows from Hugging Face's rotate-half order (the first half of the head's
    rotary pairs, then the second) into interleaved pairs: row ``(h, 2j + s)`` holds Hugging Face's row
    ``(h, s * head_dim / 2 + j)``. This puts them back.
    """
    rows = w.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"a q/k projection of {rows} rows cannot hold {heads} heads of even size")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as a float32 array in Hugging Face (torch) layout, by the ``gguf`` package's dequantiser."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(f"tensor {tensor.name!r} has GGUF type {kind}, which this port does not read "
                        f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"tensor {tensor.name!r}: the gguf package cannot dequantise type {kind}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))     # GGUF lists the innermost dimension first
    return np.asarray(values, dtype=np.float32).reshape(shape)


def hf_tensors(reader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor of the model, float32, by Hugging Face name and in Hugging Face layout."""
    arch = config["model_type"]
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        value = dequantize(tensor)
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            value = unpermute_qk(value, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            value = unpermute_qk(value, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(value)
    return out


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------
def hf_tokenizer_files(reader) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (texts) of a GGUF file's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {kind!r} is not supported; only byte-level BPE ('gpt2', the "
                        "tokenizer of SmolLM, Llama 3 and Qwen) is")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre {pre!r} is not supported; choose one of {list(PRE_TOKENIZERS)}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=pre in ("llama3", "llama-bpe")))
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    elif pre in ("gpt2", "default"):
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        regex = _QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    specials = [AddedToken(tokens[i], special=types[i] == _TOKEN_TYPE_CONTROL, normalized=False)
                for i in range(len(tokens)) if types[i] in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tokenizer.add_tokens(specials)

    def token(key: str) -> str | None:
        index = _field(reader, key, None)
        return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

    eos = token("tokenizer.ggml.eos_token_id")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id") or eos,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 4096)),
        "additional_special_tokens": [t.content for t in specials if t.special and t.content not in
                                      (eos, token("tokenizer.ggml.bos_token_id"))],
    }
    template = _field(reader, "tokenizer.chat_template", None)
    if template:
        config["chat_template"] = template
    return {"tokenizer.json": tokenizer.to_str(pretty=False), "tokenizer_config.json": json.dumps(config, indent=2)}


# ----------------------------------------------------------------------------------------------------------
# The folder
# ----------------------------------------------------------------------------------------------------------
def gguf_to_hf_folder(gguf_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                      extra_files: dict[str, str] | None = None) -> Path:
    """Write the model in ``gguf_path`` as a Hugging Face folder ``out`` (``config.json``, float32
    ``model.safetensors``, tokenizer files, and ``extra_files``: name → text). Everything is checked and written
    into a sibling temporary folder first and renamed into place at the end: on any error ``out`` is left as it
    was."""
    out = Path(out)
    check_writable(out)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise GGUFError(f"--out {str(out)!r} is not empty (pass --force to replace it)")
    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    files = hf_tokenizer_files(reader)
    tensors = hf_tensors(reader, config)
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)          # mkdtemp's 0700 would outlive the rename
    except OSError as e:
        raise GGUFError(f"cannot write under {str(parent)!r}: {e.strerror or e}") from None
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}, indent=2))
        for name, text in {**files, **(extra_files or {})}.items():
            (staging / name).write_text(text)
        write_safetensors(staging / "model.safetensors", tensors, metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise GGUFError(f"cannot write {str(out)!r}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


__all__ = ["GGUFError", "PRE_TOKENIZERS", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TENSOR_TYPES", "check_writable",
           "dequantize",
           "gguf_to_hf_folder", "hf_config", "hf_tensor_name", "hf_tensors", "hf_tokenizer_files", "open_gguf",
           "unpermute_qk"]
