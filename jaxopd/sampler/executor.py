"""The sampler's device side: the jitted prefill / decode steps and the ``Executor`` that holds their state.

Owns the model state (and the check that a new state has the served model's paths, shapes and dtypes) and
one KV cache per layer, donated through every call so updates are in place. The
page layout, the KV write and the attention belong to the attention backend (``kernels.get_backend``): the
executor only turns page tables and positions into logical write coordinates (page id, offset) and asks the
backend. Token sampling is ``jaxopd.sampler.sampling``; shape buckets are ``jaxopd.sampler.buckets``. Every
call is a pure function of padded arrays; which buckets exist is fixed at construction, and ``warmup``
compiles exactly the shapes ``Buckets`` can produce, so nothing compiles afterwards. Not thread-safe: the
engine calls it from one thread at a time.

``scan_layers=True`` (opt-in, ``EngineConfig.scan_layers``) runs the decoder layers of every step as one
``jax.lax.scan`` over a stacked copy of the layers' parameters (made once per weight update) instead of the
model's unrolled loop: one compiled layer body instead of ``num_layers`` copies, fewer arguments per call. The
layers' KV caches are then one pool of ``num_layers * num_pages`` pages (layer ``i``'s page ``p`` is page
``i * num_pages + p``), so the scanned body writes and reads its layer's pages in place by shifting page ids;
the model's modules are unchanged (``LayerScan``; the scan body is ``jaxopd.models.decoder.scan_layers``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd_kernels import registry as kernels
from jaxopd.models.logprobs import token_log_probs
from jaxopd.models.decoder import CausalLM, rope_cos_sin, scan_layers
from jaxopd.sampler.allocator import NULL_PAGE
from jaxopd.sampler.buckets import Buckets
from jaxopd.sampler.sampling import SamplingArrays, sample_tokens


# ----------------------------------------------------------------------------------------------------------
# Batches passed from the host (numpy, already padded to a bucket)
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DecodeBatch:
    tokens: np.ndarray        # int32 [R]: the last token of each sequence
    positions: np.ndarray     # int32 [R]: its position (= tokens already cached)
    page_table: np.ndarray    # int32 [R, P]
    active: np.ndarray        # bool [R]
    sampling: SamplingArrays


@dataclasses.dataclass
class PrefillBatch:
    tokens: np.ndarray        # int32 [R, L]: one chunk per row
    starts: np.ndarray        # int32 [R]: position of the chunk's first token
    lengths: np.ndarray       # int32 [R]: real tokens in the chunk (0 for padding rows)
    page_table: np.ndarray    # int32 [R, max_pages_per_seq]
    sampling: SamplingArrays


@dataclasses.dataclass
class MixedBatch:
    """A prefill batch and a decode batch run as one device step (``mixed_step``): the decode rows are padded
    to ``Buckets.mixed_decode_rows`` and their page tables span the whole window (``max_pages_per_seq``)."""

    prefill: PrefillBatch
    decode: DecodeBatch


@dataclasses.dataclass
class ScoreBatch:
    """A prefill batch whose every position also scores its next token (``targets``)."""

    tokens: np.ndarray        # int32 [R, L]: one chunk per row
    starts: np.ndarray        # int32 [R]
    lengths: np.ndarray       # int32 [R]
    page_table: np.ndarray    # int32 [R, max_pages_per_seq]
    targets: np.ndarray       # int32 [R, L]: the token following each position (0 where not scored)
    temperature: np.ndarray   # float32 [R]


# ----------------------------------------------------------------------------------------------------------
# Jitted steps: module-level, so engines over the same model graph, backend and page geometry share compilations
# ----------------------------------------------------------------------------------------------------------
def _paged_attend(backend: kernels.AttentionBackend, write_pages, write_offsets, attention,
                  pages_per_layer: int | None = None):
    """The model's attention step over a paged cache: the backend writes the new keys/values, then
    ``attention(q, layer_cache, shift)`` attends over everything cached, reading page tables through ``shift``.
    With ``pages_per_layer`` the cache is the layers' one pool (``scan_layers``): layer ``i`` owns pages
    ``i * pages_per_layer + p``, so the write's page ids and every page table are shifted by that."""
    def attend(layer_index, q, k, v, layer_cache):
        if pages_per_layer is None:
            pages, shift = write_pages, _no_shift
        else:
            offset = jnp.asarray(layer_index, jnp.int32) * pages_per_layer
            pages, shift = write_pages + offset, lambda table: table + offset
        layer_cache = backend.write(layer_cache, k, v, pages, write_offsets)
        return attention(q, layer_cache, shift), layer_cache
    return attend


def _no_shift(table):
    return table


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """How ``scan_layers`` splits the model state's leaves: the non-layer leaves (embedding, final norm, head)
    stay as they are, and leaf ``j`` of every layer is stacked into one ``[num_layers, ...]`` array. Static (part
    of ``StaticModel``): positions in the full state's leaves, the layer's graph and leaf structure, and the
    pages per layer of the cache pool."""

    layer_graphdef: Any
    layer_treedef: Any
    outer: tuple[int, ...]                     # positions of the non-layer leaves in the full state's leaves
    layers: tuple[tuple[int, ...], ...]        # layers[i][j]: position of layer i's leaf j
    abstract: tuple[Any, ...]                  # ShapeDtypeStruct of every full leaf (placeholders for layers)
    pages_per_layer: int

    @classmethod
    def of(cls, model: CausalLM, state: Any, pages_per_layer: int) -> "LayerScan":
        full = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        index = {path: k for k, path in enumerate(full)}
        layer_graphdef, layer_state = nnx.split(model.layers[0])
        suffixes = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(layer_state)[0]]
        try:
            layers = tuple(tuple(index[f"['layers'][{i}]{suffix}"] for suffix in suffixes)
                           for i in range(len(model.layers)))
        except KeyError as missing:
            raise ValueError(f"scan_layers: the layers' parameters differ in structure ({missing})") from None
        in_layers = {k for layer in layers for k in layer}
        outer = tuple(k for k in range(len(full)) if k not in in_layers)
        extra = [full[k] for k in outer if full[k].startswith("['layers']")]
        if extra:
            raise ValueError(f"scan_layers: the layers' parameters differ in structure ({extra[0]})")
        return cls(layer_graphdef, jax.tree.structure(layer_state), outer, layers,
                   tuple(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(state)),
                   pages_per_layer)

    def split(self, leaves: list) -> tuple[list, list]:
        """The full state's leaves as (non-layer leaves, stacked layer leaves); stacking copies the layers."""
        return [leaves[k] for k in self.outer], _stack_layers([[leaves[k] for k in layer] for layer in self.layers])

    def __hash__(self) -> int:
        return hash((self.layer_graphdef, self.layer_treedef, self.outer, self.layers, self.pages_per_layer))


@jax.jit
def _stack_layers(layers):
    return [jnp.stack(leaves) for leaves in zip(*layers)]


class StaticModel:
    """The static half of a split model for the jitted steps: the graph definition and the state's tree
    structure (and the ``LayerScan`` of ``scan_layers``), hashed once. (Hashing an ``nnx.GraphDef`` costs about
    50 µs, and jit hashes its static arguments on every call; equality is checked by identity first.) Equal
    graphs and structures are equal, so engines over the same model graph still share compilations."""

    __slots__ = ("graphdef", "treedef", "scan", "_hash")

    def __init__(self, graphdef, treedef, scan: LayerScan | None = None):
        self.graphdef, self.treedef, self.scan = graphdef, treedef, scan
        self._hash = hash((graphdef, treedef, scan))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticModel) and self._hash == other._hash
                                 and self.graphdef == other.graphdef and self.treedef == other.treedef
                                 and self.scan == other.scan)


def _merge(static: StaticModel, state_leaves) -> CausalLM:
    """The model of a step's state leaves. Under ``scan_layers`` its layers hold shape-only placeholders (only the
    embedding, final norm and head are read from it; ``_hidden_states`` scans the stacked layer leaves)."""
    if static.scan is None:
        return nnx.merge(static.graphdef, jax.tree.unflatten(static.treedef, state_leaves))
    full = list(static.scan.abstract)
    for k, leaf in zip(static.scan.outer, state_leaves[0]):
        full[k] = leaf
    return nnx.merge(static.graphdef, jax.tree.unflatten(static.treedef, full))


def _hidden_states(static: StaticModel, model: CausalLM, state_leaves, tokens, positions, attend, kv):
    """``model.hidden_states`` (the unrolled layers, one cache per layer), or under ``scan_layers`` the same
    computation with the layers as one ``lax.scan`` over the stacked layer leaves, threading the one cache pool."""
    scan = static.scan
    if scan is None:
        return model.hidden_states(tokens, positions, attend, kv)
    cfg = model.config
    x = jnp.take(model.embedding_vd[...], tokens, axis=0).astype(jnp.dtype(cfg.dtype))
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)

    x, kv = scan_layers(scan.layer_graphdef, state_leaves[1], x, cos, sin, attend, kv, treedef=scan.layer_treedef)
    return model.final_norm(x), kv


def _pages_per_layer(static: StaticModel) -> int | None:
    return None if static.scan is None else static.scan.pages_per_layer


def _first_layer(static: StaticModel, kv):
    """A cache the backend can read the page size of: the first layer's, or the pool under ``scan_layers``."""
    return kv if static.scan is not None else kv[0]


def _decode_writes(positions, active, page_table, page_size):
    """Where one token per row writes its KV: (page ids, offsets) ``[R]``; inactive rows write to the null page."""
    page_index = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
    pages = jnp.where(active, page_table[jnp.arange(positions.shape[0]), page_index], NULL_PAGE)
    return pages, jnp.where(active, positions % page_size, 0)


def _chunk_writes(starts, lengths, length, page_table, page_size):
    """A prompt chunk per row: its positions ``[R, L]`` and where each token writes its KV (page ids, offsets
    ``[R, L]``); padding positions write to the null page."""
    offsets = jnp.arange(length)[None, :]
    positions = starts[:, None] + offsets
    valid = offsets < lengths[:, None]
    page_index = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
    pages = jnp.where(valid, jnp.take_along_axis(page_table, page_index, axis=1), NULL_PAGE)
    return positions, pages, jnp.where(valid, positions % page_size, 0)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_step(static: StaticModel, backend: kernels.AttentionBackend, state_leaves, kv, head_dv, tokens,
                positions, page_table, active, temperature, top_p, top_k, seeds):
    """One token for every row: write its KV at ``positions``, attend over the row's pages, sample.
    ``state_leaves``: the model state's leaves (flattened once per weight update, not per call; under
    ``scan_layers`` the pair (non-layer leaves, stacked layer leaves))."""
    model = _merge(static, state_leaves)
    write_pages, write_offsets = _decode_writes(positions, active, page_table,
                                                backend.page_size(_first_layer(static, kv)))
    write_pages, write_offsets = write_pages[:, None], write_offsets[:, None]

    def attention(q, layer_cache, shift):
        return backend.decode_attention(q[:, 0], layer_cache, shift(page_table), positions + 1)[:, None]

    attend = _paged_attend(backend, write_pages, write_offsets, attention, _pages_per_layer(static))
    hidden, kv = _hidden_states(static, model, state_leaves, tokens[:, None], positions[:, None], attend, kv)
    logits = model.logits(hidden[:, 0], head_dv)
    next_tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, seeds, positions + 1)
    return kv, next_tokens, logprobs


def _prefill_hidden(static: StaticModel, model, state_leaves, backend: kernels.AttentionBackend, kv, tokens,
                    starts, lengths, page_table):
    """The model's hidden states over one prompt chunk per row, writing the chunk's KV into its pages (padding
    positions write to the null page) and attending causally over everything cached: the shared body of
    ``prefill_step`` and ``score_step``."""
    positions, write_pages, write_offsets = _chunk_writes(starts, lengths, tokens.shape[1], page_table,
                                                          backend.page_size(_first_layer(static, kv)))

    def attention(q, layer_cache, shift):
        return backend.prefill_attention(q, layer_cache, shift(page_table), positions)

    attend = _paged_attend(backend, write_pages, write_offsets, attention, _pages_per_layer(static))
    return _hidden_states(static, model, state_leaves, tokens, positions, attend, kv)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def prefill_step(static: StaticModel, backend: kernels.AttentionBackend, state_leaves, kv, head_dv, tokens, starts,
                 lengths, page_table, temperature, top_p, top_k, seeds):
    """One prompt chunk per row: write its KV, attend causally over everything cached, sample after the
    chunk's last real token (used only when the chunk completes the prompt)."""
    model = _merge(static, state_leaves)
    hidden, kv = _prefill_hidden(static, model, state_leaves, backend, kv, tokens, starts, lengths, page_table)
    last = jnp.maximum(lengths - 1, 0)
    logits = model.logits(hidden[jnp.arange(tokens.shape[0]), last], head_dv)
    next_tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, seeds, starts + lengths)
    return kv, next_tokens, logprobs


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def mixed_step(static: StaticModel, backend: kernels.AttentionBackend, state_leaves, kv, head_dv, prefill, decode):
    """``prefill_step`` and ``decode_step`` in one device step (a ragged batch): the prefill chunks' tokens and
    the decode rows' tokens are one token sequence for every token-wise layer (one read of the weights, one
    launch per layer), each writes its KV into its own pages, and only attention is split by kind: the chunks
    through ``backend.prefill_attention``, the decode rows through ``backend.decode_attention``.
    ``prefill`` = (tokens [Rp, L], starts, lengths, page_table [Rp, P], temperature, top_p, top_k, seeds);
    ``decode`` = (tokens [Rd], positions, page_table [Rd, P], active, temperature, top_p, top_k, seeds).
    Returns the cache, then (tokens, log-probs) of the prefill rows and of the decode rows."""
    model = _merge(static, state_leaves)
    p_tokens, p_starts, p_lengths, p_table, *p_sampling = prefill
    d_tokens, d_positions, d_table, d_active, *d_sampling = decode
    page_size = backend.page_size(_first_layer(static, kv))
    rows_p, length = p_tokens.shape
    n_prefill = rows_p * length
    p_positions, p_pages, p_offsets = _chunk_writes(p_starts, p_lengths, length, p_table, page_size)
    d_pages, d_offsets = _decode_writes(d_positions, d_active, d_table, page_size)
    write_pages = jnp.concatenate([p_pages.reshape(-1), d_pages])[None, :]
    write_offsets = jnp.concatenate([p_offsets.reshape(-1), d_offsets])[None, :]

    def attention(q, layer_cache, shift):
        q_prefill = q[0, :n_prefill].reshape(rows_p, length, *q.shape[2:])
        out_prefill = backend.prefill_attention(q_prefill, layer_cache, shift(p_table), p_positions)
        out_decode = backend.decode_attention(q[0, n_prefill:], layer_cache, shift(d_table), d_positions + 1)
        return jnp.concatenate([out_prefill.reshape(n_prefill, *q.shape[2:]), out_decode])[None]

    attend = _paged_attend(backend, write_pages, write_offsets, attention, _pages_per_layer(static))
    tokens = jnp.concatenate([p_tokens.reshape(-1), d_tokens])[None, :]
    positions = jnp.concatenate([p_positions.reshape(-1), d_positions])[None, :]
    hidden, kv = _hidden_states(static, model, state_leaves, tokens, positions, attend, kv)
    last = jnp.maximum(p_lengths - 1, 0)
    p_hidden = hidden[0, :n_prefill].reshape(rows_p, length, -1)[jnp.arange(rows_p), last]
    logits = model.logits(jnp.concatenate([p_hidden, hidden[0, n_prefill:]]), head_dv)
    sampling = [jnp.concatenate([a, b]) for a, b in zip(p_sampling, d_sampling)]
    next_tokens, logprobs = sample_tokens(logits, *sampling, jnp.concatenate([p_starts + p_lengths,
                                                                              d_positions + 1]))
    return kv, (next_tokens[:rows_p], logprobs[:rows_p]), (next_tokens[rows_p:], logprobs[rows_p:])


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def score_step(static: StaticModel, backend: kernels.AttentionBackend, state_leaves, kv, head_dv, tokens, starts,
               lengths, page_table, targets, temperature):
    """A prefill chunk per row (KV written as ``prefill_step`` does) that returns, at every position, the
    float32 log-probability of ``targets`` there under ``tempered_log_softmax(logits, temperature)``.
    The vocabulary projection runs one row at a time (``[L, V]`` logits, never ``[R, L, V]``)."""
    model = _merge(static, state_leaves)
    hidden, kv = _prefill_hidden(static, model, state_leaves, backend, kv, tokens, starts, lengths, page_table)

    def row_log_probs(args):
        row_hidden, row_targets, row_temperature = args
        return token_log_probs(model.logits(row_hidden, head_dv), row_targets,
                               jnp.broadcast_to(row_temperature, row_targets.shape))

    logprobs = jax.lax.map(row_log_probs, (hidden, targets, temperature))
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return kv, jnp.where(valid, logprobs, 0.0)


@jax.jit
def _transposed_embedding(state):
    return jnp.transpose(state["embedding_vd"][...])


def _sampling_tuple(s: SamplingArrays) -> tuple:
    return s.temperature, s.top_p, s.top_k, s.seeds


def compiled_count() -> int:
    """Entries in the step functions' jit caches (a test asserts this stops growing after warm-up)."""
    return (decode_step._cache_size() + prefill_step._cache_size() + score_step._cache_size()
            + mixed_step._cache_size())


# ----------------------------------------------------------------------------------------------------------
# The executor
# ----------------------------------------------------------------------------------------------------------
def _path_leaves(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Executor:
    """Holds the model state and the per-layer KV caches (laid out by ``attention_backend``); runs the jitted
    prefill and decode steps on host batches."""

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int, buckets: Buckets,
                 attention_backend: str = "auto", scoring: bool = True, mixed_steps: bool = False,
                 scan_layers: bool = False):
        cfg = model.config
        self.config = cfg
        self.num_pages = num_pages
        self.page_size = page_size
        self.buckets = buckets
        self.backend = kernels.get_backend(kernels.resolve_backend_name(attention_backend))
        self.scoring = scoring
        self.mixed_steps = mixed_steps
        self.graphdef, self.state = nnx.split(model)
        self._state_treedef = jax.tree.structure(self.state)
        self.scan_layers = scan_layers
        self._scan = LayerScan.of(model, self.state, num_pages) if scan_layers else None
        pool = cfg.num_layers * num_pages * page_size * cfg.num_kv_heads * cfg.head_dim
        if scan_layers and getattr(self.backend, "decode_in_place", False) and pool >= 2 ** 31:
            raise ValueError(f"scan_layers: the layers' one page pool would hold {pool:,} elements per K/V array, "
                             f"past the 32-bit offsets of the {self.backend.name} kernel; lower num_pages")
        self._abstract_state = {path: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                                for path, leaf in _path_leaves(self.state).items()}
        self.head_dv = None
        self._materialize_head = cfg.tie_word_embeddings and jax.default_backend() == "cpu"
        self.set_state(self.state)
        self.kv = self._new_cache()

    def _new_cache(self) -> Any:
        """One cache per layer, or under ``scan_layers`` one pool of ``num_layers * num_pages`` pages."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if self.scan_layers:
            return self.backend.init_layer_cache(cfg.num_layers * self.num_pages, self.page_size, cfg.num_kv_heads,
                                                 cfg.head_dim, dtype)
        return [self.backend.init_layer_cache(self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
                for _ in range(cfg.num_layers)]

    def ensure_cache(self) -> bool:
        """Re-create the KV caches if a failed step left them deleted (donated); True if it did. Every
        sequence that had KV in them must then be recomputed (the engine fails the ones of the failed step)."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.kv) if hasattr(leaf, "is_deleted")):
            self.kv = self._new_cache()
            return True
        return False

    def decode(self, batch: DecodeBatch) -> tuple[jax.Array, jax.Array]:
        """Dispatch one decode step; returns its (tokens, log-probs) without waiting for them (``np.asarray``
        waits). ``batch.tokens`` may be the tokens array of the previous step, still on the device.

        The host arrays of ``batch`` may be used by the device until the step's outputs are ready (the CPU
        backend can alias numpy memory): the caller must not write into them before that, on every device
        (``jax.block_until_ready``; ``np.asarray`` of a replicated output waits for one replica only)."""
        s = batch.sampling
        self.kv, tokens, logprobs = decode_step(
            self._static, self.backend, self._state_leaves, self.kv, self.head_dv, batch.tokens,
            batch.positions, batch.page_table, batch.active, s.temperature, s.top_p, s.top_k, s.seeds)
        return tokens, logprobs

    def prefill(self, batch: PrefillBatch) -> tuple[np.ndarray, np.ndarray]:
        s = batch.sampling
        self.kv, tokens, logprobs = prefill_step(
            self._static, self.backend, self._state_leaves, self.kv, self.head_dv, batch.tokens, batch.starts,
            batch.lengths, batch.page_table, s.temperature, s.top_p, s.top_k, s.seeds)
        return np.asarray(tokens), np.asarray(logprobs)

    def mixed(self, batch: MixedBatch) -> tuple[np.ndarray, np.ndarray, jax.Array, jax.Array]:
        """Run ``batch``'s prefill and decode rows as one step; returns the prefill rows' (tokens, log-probs) on
        the host and the decode rows' on the device (the same contract as ``decode`` for its host arrays)."""
        p, d = batch.prefill, batch.decode
        self.kv, (p_tokens, p_logprobs), (d_tokens, d_logprobs) = mixed_step(
            self._static, self.backend, self._state_leaves, self.kv, self.head_dv,
            (p.tokens, p.starts, p.lengths, p.page_table, *_sampling_tuple(p.sampling)),
            (d.tokens, d.positions, d.page_table, d.active, *_sampling_tuple(d.sampling)))
        jax.block_until_ready((p_tokens, p_logprobs, d_tokens, d_logprobs))
        return np.asarray(p_tokens), np.asarray(p_logprobs), d_tokens, d_logprobs

    def score(self, batch: ScoreBatch) -> np.ndarray:
        """Prefill ``batch`` and return the float32 ``[R, L]`` log-probs of its targets."""
        self.kv, logprobs = score_step(
            self._static, self.backend, self._state_leaves, self.kv, self.head_dv, batch.tokens, batch.starts,
            batch.lengths, batch.page_table, batch.targets, batch.temperature)
        return np.asarray(logprobs)

    def check_state(self, state: Any) -> Any:
        """``state`` as the served model's state, or ``ValueError`` naming the first mismatching path.

        It must be an ``nnx.State`` (not the module: pass ``nnx.state(model)``) with the served model's paths,
        and at each path an array of the same shape and dtype: anything else would fail in the step or
        recompile it. Returns the same leaves under the served state's tree structure (so variable metadata
        that differs, e.g. sharding annotations, cannot cause a recompilation).
        """
        if isinstance(state, nnx.Module):
            raise ValueError(f"update_weights takes the model's parameters as an nnx.State (nnx.state(model) or "
                             f"nnx.split(model)[1]), not the {type(state).__name__} module itself")
        if not isinstance(state, nnx.State):
            raise ValueError(f"update_weights takes an nnx.State of the served model, got {type(state).__name__}")
        got = _path_leaves(state)
        for path, expected in self._abstract_state.items():
            if path not in got:
                raise ValueError(f"new state lacks {path} (expected {expected.dtype}{list(expected.shape)}): "
                                 "not the served model's architecture")
            leaf = got[path]
            shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
            if shape is None or dtype is None:
                raise ValueError(f"new state has a {type(leaf).__name__} at {path}, expected an array "
                                 f"{expected.dtype}{list(expected.shape)}")
            if tuple(shape) != tuple(expected.shape):
                raise ValueError(f"new state has shape {list(shape)} at {path}, expected {list(expected.shape)}")
            if jnp.dtype(dtype) != expected.dtype:
                raise ValueError(f"new state has dtype {jnp.dtype(dtype)} at {path}, expected {expected.dtype}")
        extra = [path for path in got if path not in self._abstract_state]
        if extra:
            raise ValueError(f"new state has {extra[0]}, which the served model does not (e.g. an untied "
                             f"output head or more layers): not the served model's architecture")
        return jax.tree.unflatten(self._state_treedef, [got[path] for path in self._abstract_state])

    def set_state(self, state: Any) -> None:
        """Swap in new weights (same structure, shapes and dtypes, see ``check_state``: no recompilation). On
        CPU a tied model also keeps a ``[D, V]`` copy of its embedding for the logits matmul; under
        ``scan_layers`` the steps read a stacked copy of the layers' parameters, made here (the layers' bytes
        once more in device memory)."""
        self.state = state
        self._static = StaticModel(self.graphdef, self._state_treedef, self._scan)
        leaves = jax.tree.leaves(state)
        self._state_leaves = leaves if self._scan is None else self._scan.split(leaves)
        if self._materialize_head:
            self.head_dv = _transposed_embedding(state)

    def warmup(self) -> int:
        """Compile every bucket (``Buckets.decode_shapes`` / ``prefill_shapes``, the shapes the engine's steps
        can take; the scoring step on every prefill shape too when ``scoring``, the mixed step on every prefill
        shape when ``mixed_steps``) with dummy work that writes only to the null page; returns the number of
        compiled shapes."""
        n = 0
        max_pages = self.buckets.max_pages_per_seq
        for rows, pages in self.buckets.decode_shapes():
            tokens = np.zeros(rows, np.int32)
            for _ in range(2):   # host tokens (a run's first step), then the previous step's tokens on the device
                tokens, _ = self.decode(dataclasses.replace(_idle_decode(rows, pages), tokens=tokens))
            n += 1
        for rows, length in self.buckets.prefill_shapes():
            self.prefill(_idle_prefill(rows, length, max_pages))
            n += 1
            if self.scoring:
                idle = _idle_prefill(rows, length, max_pages)
                self.score(ScoreBatch(idle.tokens, idle.starts, idle.lengths, idle.page_table,
                                      np.zeros((rows, length), np.int32), np.ones(rows, np.float32)))
                n += 1
            if self.mixed_steps:
                self.mixed(MixedBatch(_idle_prefill(rows, length, max_pages),
                                      _idle_decode(self.buckets.mixed_decode_rows, max_pages)))
                n += 1
        jax.block_until_ready(self.kv)
        return n


def _idle_decode(rows: int, pages: int) -> DecodeBatch:
    """A warm-up decode batch of a padded shape: every row inactive (it writes only to the null page)."""
    return DecodeBatch(np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.zeros((rows, pages), np.int32),
                       np.zeros(rows, bool), SamplingArrays.empty(rows))


def _idle_prefill(rows: int, length: int, pages: int) -> PrefillBatch:
    """A warm-up prefill batch of a padded shape: every chunk empty (it writes only to the null page)."""
    return PrefillBatch(np.zeros((rows, length), np.int32), np.zeros(rows, np.int32), np.zeros(rows, np.int32),
                        np.zeros((rows, pages), np.int32), SamplingArrays.empty(rows))


__all__ = ["DecodeBatch", "PrefillBatch", "MixedBatch", "StaticModel", "LayerScan", "ScoreBatch", "decode_step",
           "prefill_step", "mixed_step", "score_step", "compiled_count", "Executor"]
