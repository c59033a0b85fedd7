"""Paged-attention backends behind one signature, chosen by name.

Every backend computes ``paged_attention(q, k_pages, v_pages, page_table, q_positions) -> out`` with
``q`` ``[B, T, num_heads, H]``, pages ``[num_pages, page_size, num_kv_heads, H]``, ``page_table`` ``[B, P]``
(page ids of each row's sequence, in order) and ``q_positions`` ``[B, T]`` (absolute position of each
query; a query sees every cached position <= its own). ``reference`` is pure jnp and runs anywhere; a
Pallas GPU or TPU ragged kernel registers itself here under another name and the engine picks it by name.
"""
from __future__ import annotations

from typing import Callable

from kernels.paged_attention_reference import paged_attention_reference, write_kv_pages

PagedAttentionFn = Callable[..., "object"]

_BACKENDS: dict[str, PagedAttentionFn] = {"reference": paged_attention_reference}


def register_backend(name: str, fn: PagedAttentionFn) -> None:
    """Make ``fn`` available as ``get_backend(name)``."""
    _BACKENDS[name] = fn


def get_backend(name: str) -> PagedAttentionFn:
    if name not in _BACKENDS:
        raise ValueError(f"unknown paged-attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


__all__ = ["get_backend", "register_backend", "available_backends", "write_kv_pages", "paged_attention_reference"]
