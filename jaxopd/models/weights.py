"""Hugging Face checkpoints (Qwen3, Llama) in and out: a declarative key map between safetensors and the NNX model.

Owns reading a local HF folder (``config.json`` + single or sharded ``*.safetensors``) into a ``CausalLM``
(``load_model``),
optionally straight into given shardings (each device reads only its slice from the memory-mapped file),
writing a model back to a folder that ``transformers`` loads, and ``cut_layers`` (a smaller model cut from a model's
decoder layers). Never downloads anything.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxopd.models.decoder import CausalLM, ModelConfig, abstract_model

# ----------------------------------------------------------------------------------------------------------
# The key map
# ----------------------------------------------------------------------------------------------------------
# Layouts: how a torch tensor ``[out, in]`` becomes our einsum weight, and back.
#   heads_in:  q/k/v_proj  [N*H, D]  <->  [D, N, H]
#   heads_out: o_proj      [D, N*H]  <->  [N, H, D]
#   transpose: Linear      [out, in] <->  [in, out]
#   same:      embeddings and norms, unchanged


def _heads_in(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, -1, w.shape[-1]).transpose(2, 0, 1)


def _heads_in_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.transpose(1, 2, 0).reshape(-1, w.shape[0])


def _heads_out(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(w.shape[0], heads, -1).transpose(1, 2, 0)


def _heads_out_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.transpose(2, 0, 1).reshape(w.shape[2], -1)


@dataclasses.dataclass(frozen=True)
class KeyRule:
    hf_key: str                         # ``{i}`` stands for the layer index
    model_path: tuple[str, ...]         # path below ``layers/{i}`` for per-layer rules
    layout: str = "same"                # same | transpose | heads_in | heads_out
    heads: str = ""                     # config field giving the head count for heads_* layouts


GLOBAL_RULES = (
    KeyRule("model.embed_tokens.weight", ("embedding_vd",)),
    KeyRule("model.norm.weight", ("final_norm", "scale")),
)
UNTIED_HEAD_RULE = KeyRule("lm_head.weight", ("lm_head_dv",), "transpose")
LAYER_RULES = (
    KeyRule("model.layers.{i}.input_layernorm.weight", ("input_norm", "scale")),
    KeyRule("model.layers.{i}.post_attention_layernorm.weight", ("post_attention_norm", "scale")),
    KeyRule("model.layers.{i}.self_attn.q_proj.weight", ("attn", "q_weight_dnh"), "heads_in", "num_heads"),
    KeyRule("model.layers.{i}.self_attn.k_proj.weight", ("attn", "k_weight_dkh"), "heads_in", "num_kv_heads"),
    KeyRule("model.layers.{i}.self_attn.v_proj.weight", ("attn", "v_weight_dkh"), "heads_in", "num_kv_heads"),
    KeyRule("model.layers.{i}.self_attn.o_proj.weight", ("attn", "o_weight_nhd"), "heads_out", "num_heads"),
    KeyRule("model.layers.{i}.mlp.gate_proj.weight", ("mlp", "gate_weight_df"), "transpose"),
    KeyRule("model.layers.{i}.mlp.up_proj.weight", ("mlp", "up_weight_df"), "transpose"),
    KeyRule("model.layers.{i}.mlp.down_proj.weight", ("mlp", "down_weight_fd"), "transpose"),
)
QK_NORM_RULES = (   # Qwen3 only (ModelConfig.qk_norm)
    KeyRule("model.layers.{i}.self_attn.q_norm.weight", ("attn", "q_norm", "scale")),
    KeyRule("model.layers.{i}.self_attn.k_norm.weight", ("attn", "k_norm", "scale")),
)


def key_map(cfg: ModelConfig) -> dict[str, tuple[tuple[Any, ...], KeyRule]]:
    """Every HF tensor name of this architecture → (model state path, rule)."""
    out = {r.hf_key: (r.model_path, r) for r in GLOBAL_RULES}
    if not cfg.tie_word_embeddings:
        out[UNTIED_HEAD_RULE.hf_key] = (UNTIED_HEAD_RULE.model_path, UNTIED_HEAD_RULE)
    rules = LAYER_RULES + (QK_NORM_RULES if cfg.qk_norm else ())
    for i in range(cfg.num_layers):
        for r in rules:
            out[r.hf_key.format(i=i)] = (("layers", i) + r.model_path, r)
    return out


def to_model_layout(w: np.ndarray, rule: KeyRule, cfg: ModelConfig) -> np.ndarray:
    """A torch-layout array as our layout (a view where possible: no copy of a memory-mapped tensor)."""
    if rule.layout == "same":
        return w
    if rule.layout == "transpose":
        return w.T
    heads = getattr(cfg, rule.heads)
    return _heads_in(w, heads) if rule.layout == "heads_in" else _heads_out(w, heads)


def to_hf_layout(w: np.ndarray, rule: KeyRule, cfg: ModelConfig) -> np.ndarray:
    if rule.layout == "same":
        return w
    if rule.layout == "transpose":
        return np.ascontiguousarray(w.T)
    heads = getattr(cfg, rule.heads)
    w = _heads_in_back(w, heads) if rule.layout == "heads_in" else _heads_out_back(w, heads)
    return np.ascontiguousarray(w)


# ----------------------------------------------------------------------------------------------------------
# safetensors, memory-mapped (numpy has no bfloat16; ml_dtypes does)
# ----------------------------------------------------------------------------------------------------------
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class SafetensorsFile:
    """Read-only, memory-mapped view of one ``.safetensors`` file: ``file[name]`` is a numpy view, no copy."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{str(self.path)!r} is cut off: {size} bytes, shorter than a safetensors header")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", self._mmap[:8])
        try:
            if 8 + header_len > size:
                raise ValueError(f"its header is said to take {header_len:,} bytes")
            header = json.loads(self._mmap[8:8 + header_len].decode("utf-8"))
        except ValueError as e:
            raise CheckpointError(f"{str(self.path)!r} is not a readable safetensors file ({size:,} bytes): "
                                  f"{e}") from None
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + header_len
        needed = self._data_start + max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if size < needed:
            raise CheckpointError(f"{str(self.path)!r} is cut off: its header needs {needed:,} bytes, the file has "
                                  f"{size:,}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        count = (end - start) // dtype.itemsize
        arr = np.frombuffer(self._mmap, dtype=dtype, count=count, offset=self._data_start + start)
        return arr.reshape(entry["shape"])


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (bfloat16 via ml_dtypes included) in the safetensors format."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


# ----------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------
class CheckpointError(ValueError):
    """A checkpoint folder that cannot become a model (the message names the file or tensor)."""


def read_config(folder: str | os.PathLike, *, dtype: str | None = None) -> ModelConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} has no config.json")
    try:
        return ModelConfig.from_hf_dict(json.loads(config_path.read_text()), dtype=dtype)
    except ValueError as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def check_checkpoint_files(folder: str | os.PathLike) -> ModelConfig:
    """``CheckpointError`` unless ``folder`` holds a Qwen3 or Llama ``config.json`` and safetensors (one file, or
    every shard its index names) each as long as its header says (a checkpoint whose writing was cut off fails);
    returns the config. Reads headers only, no tensor."""
    config = read_config(folder)
    _tensor_sources(Path(folder))
    return config


def _tensor_sources(folder: Path) -> dict[str, SafetensorsFile]:
    """Tensor name → the open file holding it (sharded checkpoints via model.safetensors.index.json)."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files: dict[str, SafetensorsFile] = {}
        for fname in sorted(set(weight_map.values())):
            if not (folder / fname).is_file():
                raise CheckpointError(f"{index_path} names shard {fname!r}, which is missing from {str(folder)!r}")
            files[fname] = SafetensorsFile(folder / fname)
        return {name: files[fname] for name, fname in weight_map.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint folder {str(folder)!r} has no *.safetensors files")
    sources: dict[str, SafetensorsFile] = {}
    for shard in shards:
        st = SafetensorsFile(shard)
        for name in st.keys():
            sources[name] = st
    return sources


ShardingSpec = Callable[[tuple[Any, ...], tuple[int, ...]], "jax.sharding.Sharding | None"]


def load_model(folder: str | os.PathLike, *, dtype: str | None = None,
               sharding: ShardingSpec | None = None) -> CausalLM:
    """Load a Hugging Face model folder into a ``CausalLM`` (parameters cast to ``dtype``, default by backend).

    ``sharding(path, shape)`` may give a ``jax.sharding.Sharding`` per parameter: each device then reads only
    its own slice from the memory-mapped safetensors, so no full host copy is made per device.
    """
    folder = Path(folder)
    cfg = read_config(folder, dtype=dtype)
    sources = _tensor_sources(folder)
    expected = key_map(cfg)
    present = set(sources)
    if cfg.tie_word_embeddings and UNTIED_HEAD_RULE.hf_key in present:
        present.discard(UNTIED_HEAD_RULE.hf_key)   # some tied checkpoints store the shared matrix twice
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected))
    if missing:
        raise CheckpointError(f"{str(folder)!r}: missing tensor(s) {missing[:5]}"
                              f"{' …' if len(missing) > 5 else ''} ({len(missing)} missing)")
    if extra:
        raise CheckpointError(f"{str(folder)!r}: unexpected tensor(s) {extra[:5]}"
                              f"{' …' if len(extra) > 5 else ''} not part of a {cfg.model_type} model of this config")

    model = abstract_model(cfg)
    graphdef, abstract_state = nnx.split(model)
    param_dtype = jnp.dtype(cfg.param_dtype)
    flat = dict(nnx.to_flat_state(abstract_state))
    for hf_key, (path, rule) in expected.items():
        variable = flat[path]
        target_shape = tuple(variable.shape)
        raw = sources[hf_key][hf_key]
        expected_hf_shape = to_hf_layout(np.empty(target_shape, np.int8), rule, cfg).shape
        if tuple(raw.shape) != tuple(expected_hf_shape):
            raise CheckpointError(f"tensor {hf_key!r} has shape {tuple(raw.shape)}, expected "
                                  f"{tuple(expected_hf_shape)} for this config")
        src = to_model_layout(raw, rule, cfg)
        target = sharding(path, target_shape) if sharding is not None else None
        if target is None:
            value = jnp.asarray(np.asarray(src).astype(param_dtype))
        else:
            value = jax.make_array_from_callback(
                target_shape, target, lambda idx, src=src: np.asarray(src[idx]).astype(param_dtype))
        variable.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ----------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------
def iter_hf_tensors(model: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, torch-layout numpy array) for every tensor of the model."""
    cfg = model.config
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for hf_key, (path, rule) in key_map(cfg).items():
        yield hf_key, to_hf_layout(np.asarray(jax.device_get(flat[path][...])), rule, cfg)


def save_model(model: CausalLM, folder: str | os.PathLike, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and safetensors (sharded with an index when over ``max_shard_bytes``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    tensors = dict(iter_hf_tensors(model))
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        write_safetensors(folder / "model.safetensors", tensors)
        return folder
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, shard)
        weight_map.update({name: fname for name in shard})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def cut_layers(model: CausalLM, keep: Sequence[int]) -> CausalLM:
    """A smaller model cut from ``model``: its decoder layers ``keep`` (indices, increasing, each once), in that
    order, with the embedding, final norm and head unchanged (a student made from its teacher's pretrained weights).
    Keeping every layer gives the same model; the cut model is an ordinary ``CausalLM`` (``save_model`` writes a
    folder transformers loads with ``num_hidden_layers = len(keep)``)."""
    cfg = model.config
    layers = [int(i) for i in keep]
    if not layers:
        raise ValueError("a cut keeps at least one layer")
    if any(not 0 <= i < cfg.num_layers for i in layers):
        raise ValueError(f"layer indices must lie in [0, {cfg.num_layers}), got {layers}")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"the kept layers must be increasing, each once (a cut keeps their order), got {layers}")
    new_cfg = dataclasses.replace(cfg, num_layers=len(layers))
    graphdef, params = nnx.split(abstract_model(new_cfg), nnx.Param)
    old = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    flat = dict(nnx.to_flat_state(params))
    for path, variable in flat.items():
        source = ("layers", layers[int(path[1])], *path[2:]) if path[0] == "layers" else path
        variable.set_value(jnp.asarray(old[source][...]))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def model_record(model: CausalLM, *, name: str, weights: str | os.PathLike | None) -> dict[str, Any]:
    """What a result records about its model: name, parameter count, dtype, the weights folder (None: random
    weights) and ``paper_architecture``, whether it has Qwen3-1.7B's shape (ActFirst-OPD's student; any dtype)."""
    from jaxopd.models.decoder import count_params

    _, state = nnx.split(model)
    cfg = model.config
    paper = ModelConfig.preset("qwen3-1.7b", dtype=cfg.dtype)
    same_shape = dataclasses.replace(cfg, max_position_embeddings=paper.max_position_embeddings) == paper
    return {"name": name, "num_params": count_params(state), "dtype": cfg.dtype,
            "weights": None if weights is None else str(weights), "random_weights": weights is None,
            "paper_architecture": same_shape, "config": dataclasses.asdict(cfg)}


load_qwen3 = load_model     # the name before the Llama family (kept for existing scripts)
save_qwen3 = save_model

__all__ = ["CheckpointError", "KeyRule", "SafetensorsFile", "check_checkpoint_files", "cut_layers", "key_map",
           "load_model", "model_record", "read_config",
           "save_model", "write_safetensors", "iter_hf_tensors"]
