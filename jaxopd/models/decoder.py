"""The decoder-only transformer of the Llama family in Flax NNX: Qwen3 and Llama, faithful to transformers'
``modeling_qwen3`` and ``modeling_llama``.

Qwen3 is Llama plus a per-head RMSNorm on queries and keys (``ModelConfig.qk_norm``); everything else is one
code path. Owns the architecture (config presets, blocks, RoPE, RMSNorm, GQA attention, SwiGLU MLP, tied or
untied head) and one forward pass whose attention step is a pluggable function: the dense causal attention in
this file serves training and scoring, and the sampler passes a paged-cache attention that writes the
layer's keys/values into its pages. The model itself knows nothing of caches or sampling; the masked GQA
softmax is ``jaxopd_kernels.dense.grouped_attention``, shared with the paged backends. ``scan_layers`` runs the
layers as one ``lax.scan`` over stacked parameters: training's rematerialised forward and the sampler's scanned
engines share that body.

Parameters carry logical axis names in their ``axes`` metadata (``('embed', 'q_heads', 'head_dim')``, ...);
``jaxopd.models.sharding`` maps them onto a mesh.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxopd_kernels.dense import grouped_attention

Array = jax.Array


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------
MODEL_TYPES = ("qwen3", "llama")          # Hugging Face ``model_type`` values this decoder implements
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# Qwen3's <|endoftext|> / <|im_end|>: the bos/eos of a config that names none (the Qwen3 presets)
_QWEN3_BOS_EOS = (151643, 151645)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and dtype policy of a Qwen3 or Llama model (field names follow the HF config where they exist).

    ``model_type`` is the Hugging Face family written back on export; ``qk_norm`` is the one architectural switch
    between them (Qwen3: True, Llama: False).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 151_936
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40_960
    dtype: str = "float32"          # activations
    param_dtype: str = "float32"    # parameters as stored on device
    model_type: str = "qwen3"
    qk_norm: bool = True
    bos_token_id: int | None = None     # None: the family's default (Qwen3's ids for qwen3)
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type {self.model_type!r} is not supported; choose one of "
                             f"{list(MODEL_TYPES)}")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError(f"ModelConfig.qk_norm={self.qk_norm} does not match model_type {self.model_type!r} "
                             "(qwen3 normalises queries and keys per head, llama does not)")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention")

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """The ids that end a generated turn: the config's ``eos_token_id``, and for Qwen3 ``<|im_end|>`` and
        ``<|endoftext|>``."""
        if self.model_type == "qwen3" and self.eos_token_id is None:
            return (_QWEN3_BOS_EOS[1], _QWEN3_BOS_EOS[0])
        if self.model_type == "qwen3":
            return tuple(dict.fromkeys((self.eos_token_id, _QWEN3_BOS_EOS[1], _QWEN3_BOS_EOS[0])))
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def with_dtypes(self, dtype: str, param_dtype: str | None = None) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype, param_dtype=param_dtype or dtype)

    @classmethod
    def preset(cls, name: str, *, dtype: str | None = None) -> "ModelConfig":
        """A named architecture: ``qwen3-0.6b``, ``qwen3-1.7b``, ``qwen3-4b``, ``qwen3-8b``, ``tiny`` (Qwen3) or
        ``smollm2-135m`` (Llama).

        ``dtype`` defaults to the backend policy: float32 on CPU, bfloat16 on GPU/TPU.
        """
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        dtype = dtype or default_dtype()
        return dataclasses.replace(PRESETS[key], dtype=dtype, param_dtype=dtype)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, dtype: str | None = None) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict of ``model_type`` ``qwen3`` or ``llama``.

        Options this decoder does not implement are refused with a ``ValueError`` naming the field.
        """
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in MODEL_TYPES or any(a != _ARCHITECTURES[model_type] for a in archs):
            raise ValueError(f"not a Qwen3 or Llama checkpoint: model_type={model_type!r}, architectures={archs!r} "
                             "(expected model_type 'qwen3' / Qwen3ForCausalLM or 'llama' / LlamaForCausalLM)")
        for field in ("attention_bias", "mlp_bias"):
            if hf.get(field, False):
                raise ValueError(f"{field}=True is not supported (this decoder's projections have no bias)")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu', the SwiGLU MLP)")
        dtype = dtype or default_dtype()
        num_heads = hf["num_attention_heads"]
        rope_params = hf.get("rope_parameters") or {}    # transformers >= 5 nests RoPE settings here
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta"))
        if rope_theta is None:
            rope_theta = 1_000_000.0 if model_type == "qwen3" else 10_000.0
        for field, scaling in (("rope_scaling", hf.get("rope_scaling") or {}), ("rope_parameters", rope_params)):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind != "default":
                raise ValueError(f"{field} of rope_type {kind!r} is not supported (only default RoPE)")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        bos, eos = hf.get("bos_token_id"), hf.get("eos_token_id")
        if isinstance(eos, list):       # several end ids: the first is the one this config writes back
            eos = eos[0] if eos else None
        return cls(
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40_960)),
            dtype=dtype,
            param_dtype=dtype,
            model_type=model_type,
            qk_norm=model_type == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` of this architecture."""
        torch_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[self.param_dtype]
        bos, eos = self.bos_token_id, self.eos_token_id
        if self.model_type == "qwen3":
            bos = _QWEN3_BOS_EOS[0] if bos is None else bos
            eos = _QWEN3_BOS_EOS[1] if eos is None else eos
        extra: dict[str, Any] = {}
        if self.model_type == "llama":
            extra.update({"mlp_bias": False, "pretraining_tp": 1, "rope_scaling": None})
        return {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": torch_dtype,
            **extra,
        }


PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": ModelConfig(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": ModelConfig(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": ModelConfig(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=12288, tie_word_embeddings=False),
    # CPU work: the real vocabulary with a small body (42.0M parameters, 38.9M of them the embedding).
    "tiny": ModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=768, tie_word_embeddings=True),
    # Hugging Face's SmolLM2-135M-Instruct (Llama; its weights come from experiments.fetch_model)
    "smollm2-135m": ModelConfig(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                intermediate_size=1536, vocab_size=49_152, rope_theta=100_000.0, rms_norm_eps=1e-5,
                                tie_word_embeddings=True, max_position_embeddings=8192, model_type="llama",
                                qk_norm=False, bos_token_id=1, eos_token_id=2),
}


def default_dtype() -> str:
    """The dtype policy: float32 on CPU, bfloat16 on accelerators (logits are always float32)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


# ----------------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------------
def _param(rngs: nnx.Rngs, shape: Sequence[int], axes: tuple[str, ...], dtype, *, std: float = 0.02) -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=axes)


class RMSNorm(nnx.Module):
    """HF Qwen3RMSNorm / LlamaRMSNorm: normalise in float32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float, param_dtype, axis_name: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=(axis_name,))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * x32.astype(x.dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """cos/sin tables ``[..., head_dim]`` for integer positions (HF default RoPE, halves concatenated)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE. ``x``: ``[B, T, heads, H]``; ``cos``/``sin``: ``[B, T, H]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class AttendFn(Protocol):
    """The attention step of one layer: keys/values of the new tokens in, attended values out.

    ``q``: ``[B, T, num_heads, H]`` (normed, rotated), ``k``/``v``: ``[B, T, num_kv_heads, H]``;
    ``layer_cache``: whatever this function threads through layers (``None`` for dense attention).
    Returns ``([B, T, num_heads, H], new_layer_cache)``.
    """

    def __call__(self, layer_index: int, q: Array, k: Array, v: Array, layer_cache: Any) -> tuple[Array, Any]: ...


class Attention(nnx.Module):
    """GQA self-attention (Qwen3: per-head q/k RMSNorm before RoPE); the attention step itself is injected."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_weight_dnh = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), pd)
        self.k_weight_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.v_weight_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.o_weight_nhd = _param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), pd)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, pd, "head_dim")
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, pd, "head_dim")

    def project_qkv(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """Queries, keys, values of ``x`` ``[B, T, D]``, q/k (normed and) rotated: what a KV cache stores."""
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q_weight_dnh[...])
        k = jnp.einsum("BTD,DKH->BTKH", x, self.k_weight_dkh[...])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = jnp.einsum("BTD,DKH->BTKH", x, self.v_weight_dkh[...])
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, attended: Array) -> Array:
        return jnp.einsum("BTNH,NHD->BTD", attended, self.o_weight_nhd[...])


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_weight_df = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.up_weight_df = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.down_weight_fd = _param(rngs, (f, d), ("mlp", "embed"), pd)

    def __call__(self, x: Array) -> Array:
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate_weight_df[...])
        up = jnp.einsum("BTD,DF->BTF", x, self.up_weight_df[...])
        return jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_weight_fd[...])


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, "embed")
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, "embed")
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, layer_index: int, x: Array, cos: Array, sin: Array, attend: AttendFn,
                 layer_cache: Any) -> tuple[Array, Any]:
        q, k, v = self.attn.project_qkv(self.input_norm(x), cos, sin)
        attended, layer_cache = attend(layer_index, q, k, v, layer_cache)
        x = x + self.attn.output(attended.astype(x.dtype))
        x = x + self.mlp(self.post_attention_norm(x))
        return x, layer_cache


# ----------------------------------------------------------------------------------------------------------
# Dense attention (training, scoring, reference): jaxopd_kernels.dense.grouped_attention over the sequence itself
# ----------------------------------------------------------------------------------------------------------
def dense_causal_attend(positions: Array, attention_mask: Array) -> AttendFn:
    """Causal attention over the sequence itself: token i sees token j iff j is real and pos_j <= pos_i."""
    visible = (positions[:, None, :] <= positions[:, :, None]) & attention_mask[:, None, :].astype(bool)

    def attend(layer_index, q, k, v, layer_cache):
        del layer_index
        return grouped_attention(q, k, v, visible), layer_cache

    return attend


def scan_layers(layer_def: Any, stacked: Any, x: Array, cos: Array, sin: Array, attend: AttendFn, cache: Any = None,
                *, treedef: Any = None, remat: bool = False) -> tuple[Array, Any]:
    """Decoder layers of one graph ``layer_def`` over ``x`` as one ``lax.scan`` over their stacked parameters; the
    one scan body of training (``CausalLM.hidden_states(remat=True)``) and of the sampler (``scan_layers`` engines).

    ``stacked``: a layer's state with every leaf stacked ``[num_layers, ...]``, or (with ``treedef``, the layer
    state's tree structure) the list of those stacked leaves. ``cache``: one cache threaded through every layer
    (the sampler's page pool; layer ``i`` is told its index as a traced int32), None in training. ``remat``: the body
    under ``jax.checkpoint``, so a gradient keeps only each layer's input. Returns ``(x, cache)``."""
    def step(carry, xs):
        h, kv = carry
        index, state = xs
        if treedef is not None:
            state = jax.tree.unflatten(treedef, state)
        h, kv = nnx.merge(layer_def, state)(index, h, cos, sin, attend, kv)
        return (h, kv), None

    if remat:
        step = jax.checkpoint(step)
    count = jax.tree.leaves(stacked)[0].shape[0]
    (x, cache), _ = jax.lax.scan(step, (x, cache), (jnp.arange(count, dtype=jnp.int32), stacked))
    return x, cache


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------
class CausalLM(nnx.Module):
    """Qwen3ForCausalLM or LlamaForCausalLM in NNX (``config.model_type``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        pd = jnp.dtype(cfg.param_dtype)
        self.embedding_vd = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, "embed")
        if not cfg.tie_word_embeddings:
            self.lm_head_dv = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)

    def hidden_states(self, tokens: Array, positions: Array, attend: AttendFn,
                      cache: Sequence[Any] | None = None, *, remat: bool = False) -> tuple[Array, list[Any]]:
        """Final-normed hidden states ``[B, T, D]`` and the per-layer caches ``attend`` threaded through.

        ``remat`` (training): the layers run as one ``lax.scan`` over their stacked parameters, each layer's body
        rematerialised in the backward pass, so a gradient keeps one ``[B, T, D]`` input per layer instead of every
        layer's activations (its dense ``[B, H, T, T]`` attention among them). The same values; threads no caches
        (``cache`` must be None) and passes ``attend`` a traced layer index."""
        cfg = self.config
        x = jnp.take(self.embedding_vd[...], tokens, axis=0).astype(jnp.dtype(cfg.dtype))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        if remat:
            if cache is not None:
                raise ValueError("hidden_states(remat=True) is the training forward and threads no caches; "
                                 "pass cache=None")
            return self.final_norm(self._rematerialised_layers(x, cos, sin, attend)), [None] * cfg.num_layers
        cache = list(cache) if cache is not None else [None] * cfg.num_layers
        for i, layer in enumerate(self.layers):
            x, cache[i] = layer(i, x, cos, sin, attend, cache[i])
        return self.final_norm(x), cache

    def _rematerialised_layers(self, x: Array, cos: Array, sin: Array, attend: AttendFn) -> Array:
        """The layers over ``x`` as ``scan_layers`` of a ``jax.checkpoint`` body over their stacked parameters."""
        split = [nnx.split(layer) for layer in self.layers]
        layer_def, first = split[0]
        signature = jax.tree.structure(first), [(a.shape, a.dtype) for a in jax.tree.leaves(first)]
        for i, (_, state) in enumerate(split[1:], start=1):
            if (jax.tree.structure(state), [(a.shape, a.dtype) for a in jax.tree.leaves(state)]) != signature:
                raise ValueError(f"hidden_states(remat=True) stacks the layers' parameters, but layer {i}'s differ "
                                 "from layer 0's in structure, shape or dtype")
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(state for _, state in split))
        x, _ = scan_layers(layer_def, stacked, x, cos, sin, attend, remat=True)
        return x

    def logits(self, hidden: Array, head_dv: Array | None = None) -> Array:
        """float32 logits ``[..., V]`` of final hidden states ``[..., D]``.

        ``head_dv``: a ``[D, V]`` copy of the tied embedding, if the caller keeps one (XLA's CPU matmul
        against the transposed ``[V, D]`` embedding is markedly slower).
        """
        if head_dv is not None:
            return jnp.einsum("...D,DV->...V", hidden, head_dv, preferred_element_type=jnp.float32)
        if self.config.tie_word_embeddings:
            return jnp.einsum("...D,VD->...V", hidden, self.embedding_vd[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...D,DV->...V", hidden, self.lm_head_dv[...], preferred_element_type=jnp.float32)

    def head_rows(self, vocab_ids: Array) -> Array:
        """The ``[D, V']`` columns of the output head for the token ids ``vocab_ids`` ``[V']``: logits restricted to a
        sub-vocabulary are ``logits(hidden, head_dv=head_rows(ids))`` (tied or not)."""
        if self.config.tie_word_embeddings:
            return jnp.take(self.embedding_vd[...], vocab_ids, axis=0).T
        return jnp.take(self.lm_head_dv[...], vocab_ids, axis=1)

    def __call__(self, tokens: Array, positions: Array | None = None,
                 attention_mask: Array | None = None) -> Array:
        """Dense causal forward: ``tokens`` ``[B, T]`` → float32 logits ``[B, T, V]``.

        ``positions`` default to ``0..T-1``; ``attention_mask`` (1 = real token) defaults to all ones.
        With left or right padding pass the real positions of each token.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, dtype=bool)
        hidden, _ = self.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask))
        return self.logits(hidden)


def count_params(tree: Any) -> int:
    """Number of scalars in a pytree of arrays or shape structs."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """The model with shape-only parameters (no memory), e.g. to count parameters or plan shardings."""
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))

