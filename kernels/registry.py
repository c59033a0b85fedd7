"""Attention kernels: the dense GQA softmax and the paged-KV backends, chosen by name.

The package ``jaxopd_kernels`` (folder ``kernels/``, a namespace package: no ``__init__.py``, so
that the folder never shadows Hugging Face's ``kernels`` when the repository root is on
``sys.path``). This module owns the registry of ``AttentionBackend`` objects (``jaxopd_kernels.backend``):
``get_backend(name)`` returns the one object that owns a layer's KV page layout, the KV write and the prefill / decode
attention. ``reference`` (pure jnp, pages ``[num_pages, page_size, kv_heads, head_dim]``) and ``reference-hnd`` (the
same with pages ``[kv_heads, num_pages, page_size, head_dim]``) run anywhere; a Pallas GPU or TPU kernel registers
itself here under another name and the engine picks it by name (``pallas-gpu``, ``pallas-tpu``, ``pallas-tpu-ragged``;
``default_backend_name()`` picks the platform's). ``jaxopd_kernels.dense.grouped_attention`` is the dense attention
of the model. Nothing here imports ``jaxopd``.
"""
from __future__ import annotations

from jaxopd_kernels.backend import AttentionBackend, LayerCache
from jaxopd_kernels.dense import grouped_attention
from jaxopd_kernels.paged_attention_reference import (HeadsFirstReferenceBackend, ReferenceBackend,
                                                      paged_attention_reference, write_kv_pages)
from jaxopd_kernels.pallas_gpu import PallasGpuBackend
from jaxopd_kernels.pallas_tpu import PallasTpuBackend, PallasTpuRaggedBackend

_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend, name: str | None = None) -> None:
    """Make ``backend`` available as ``get_backend(name or backend.name)``."""
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"{backend!r} does not implement kernels.AttentionBackend")
    hash(backend)   # a static jit argument: must be hashable
    _BACKENDS[name or backend.name] = backend


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called ``name``."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown paged-attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def default_backend_name(platform: str | None = None) -> str:
    """The backend an engine uses when none is named: the Pallas kernel of the platform (``pallas-gpu`` on a
    GPU, ``pallas-tpu`` on a TPU), else ``reference``."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return {"gpu": "pallas-gpu", "cuda": "pallas-gpu", "tpu": "pallas-tpu"}.get(platform, "reference")


AUTO = "auto"
"""The backend name that means ``default_backend_name()`` (what ``EngineConfig.attention_backend`` defaults to)."""


def resolve_backend_name(name: str, platform: str | None = None) -> str:
    """``name`` itself when it is registered, the platform's default for ``"auto"``; else ``ValueError``
    listing the choices."""
    if name == AUTO:
        return default_backend_name(platform)
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"unknown paged-attention backend {name!r}; choose {AUTO!r} or one of {sorted(_BACKENDS)}")
    return name


register_backend(ReferenceBackend())
register_backend(HeadsFirstReferenceBackend())
register_backend(PallasGpuBackend())
register_backend(PallasTpuBackend())
register_backend(PallasTpuRaggedBackend())

__all__ = ["AttentionBackend", "LayerCache", "get_backend", "register_backend", "available_backends",
           "default_backend_name", "resolve_backend_name", "AUTO", "PallasGpuBackend", "PallasTpuBackend",
           "PallasTpuRaggedBackend",
           "grouped_attention", "ReferenceBackend", "HeadsFirstReferenceBackend", "write_kv_pages",
           "paged_attention_reference"]
