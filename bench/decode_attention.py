"""One layer's decode attention, per backend, against the KV-read roofline, at Qwen3's attention shape.

Times ``decode_attention`` of the attention backends (``reference-hnd``'s gather, ``pallas-gpu``'s in-place
kernel with automatic and with no k-splits, ``pallas-tpu`` on a TPU) for one token per row over ``--context``
cached tokens, bfloat16 pages ``[kv_heads, pages, page_size, head_dim]``, page ids shuffled. The roofline is
the bytes the step must read (K and V of every row's context) over ``--bandwidth`` (H200: 4.8 TB/s). Also
checks each backend against the gather (max abs difference). Prints a markdown table and writes JSON (after
every batch, so a time limit keeps what was measured).

``--sweep`` also times ``pallas-gpu`` over the grid ``--sweep-pages-per-block`` × ``--sweep-stages`` ×
``--sweep-warps`` × ``--sweep-k-splits`` (k-splits 0: ``auto_k_splits`` per batch); each row records its
``params``, and ``bench/profile_decode.py --from-sweep`` takes the best point into the whole decode step. One
kernel configuration alone: ``--backends pallas-gpu`` with ``--k-splits`` / ``--pages-per-block`` /
``--num-warps`` / ``--num-stages``.

    python bench/decode_attention.py --out results/bench/decode_attention.json
    python bench/decode_attention.py --sweep --batches 1 64 256 --context 256 --sweep-k-splits 0 1 4 \
        --out results/bench/decode_attention_sweep.json
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxopd import cli
from jaxopd.machine import machine_info
from jaxopd_kernels.paged_attention_reference import HeadsFirstReferenceBackend
from jaxopd_kernels.pallas_gpu import PallasGpuBackend
from jaxopd_kernels.pallas_tpu import PallasTpuBackend


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.decode_attention", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per row (all rows full)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the roofline")
    p.add_argument("--backends", nargs="+", default=None, help="default: those that run natively here")
    p.add_argument("--sweep", action="store_true",
                   help="also time pallas-gpu over the --sweep-* grid (pages per block x stages x warps x k-splits)")
    p.add_argument("--sweep-pages-per-block", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--sweep-stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--sweep-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--sweep-k-splits", type=int, nargs="+", default=[0], help="0: automatic (auto_k_splits)")
    p.add_argument("--k-splits", type=int, default=None, help="pallas-gpu: decode k-splits (0 or unset: automatic)")
    p.add_argument("--pages-per-block", type=int, default=None, help="pallas-gpu: pages per compute block")
    p.add_argument("--num-warps", type=int, default=None, help="pallas-gpu: Triton warps")
    p.add_argument("--num-stages", type=int, default=None, help="pallas-gpu: Triton pipeline stages")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def kernel_params(args) -> dict:
    """The pallas-gpu options given as flags (unset ones keep the backend's defaults)."""
    return {name: getattr(args, name) for name in ("k_splits", "pages_per_block", "num_warps", "num_stages")
            if getattr(args, name) is not None}


def pallas_params(backend: PallasGpuBackend) -> dict:
    """What ``bench/profile_decode.py --from-sweep`` sets: k-splits (0: automatic), pages per block, warps, stages."""
    return {"k_splits": backend.k_splits or 0, "pages_per_block": backend.pages_per_block,
            "num_warps": backend.num_warps, "num_stages": backend.num_stages}


def sweep_backends(args=None):
    grid = args or parse_args([])
    return {f"pallas-gpu ppb={ppb} stages={stages} warps={warps} splits={splits or 'auto'}":
            PallasGpuBackend(pages_per_block=ppb, num_stages=stages, num_warps=warps, k_splits=splits or None)
            for ppb in grid.sweep_pages_per_block for stages in grid.sweep_stages for warps in grid.sweep_warps
            for splits in grid.sweep_k_splits}


BACKEND_NAMES = ("reference-hnd", "pallas-gpu", "pallas-gpu-nosplit", "pallas-tpu")


def check_args(args) -> None:
    """The input checks, before anything is timed (``jaxopd.cli.UsageError``)."""
    for name in args.backends or ():
        if name not in BACKEND_NAMES:
            raise cli.UsageError(f"--backends {name!r} is not a backend of this bench; choose from "
                                 f"{list(BACKEND_NAMES)}")
    for flag in ("sweep_pages_per_block", "sweep_stages", "sweep_warps", "sweep_k_splits"):
        if min(getattr(args, flag)) < (0 if flag == "sweep_k_splits" else 1):
            raise cli.UsageError(f"--{flag.replace('_', '-')} takes positive values, got {getattr(args, flag)}")
    for name, value in kernel_params(args).items():
        if value < (0 if name == "k_splits" else 1):
            raise cli.UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.out:
        cli.check_out_file("--out", args.out)


def backends_for(platform_name: str, names, params: dict | None = None):
    params = dict(params or {})
    if "k_splits" in params:
        params["k_splits"] = params["k_splits"] or None
    table = {"reference-hnd": HeadsFirstReferenceBackend(),
             "pallas-gpu": PallasGpuBackend(**params),
             "pallas-gpu-nosplit": PallasGpuBackend(k_splits=1),
             "pallas-tpu": PallasTpuBackend()}
    if names is None:
        names = ["reference-hnd"] + {"gpu": ["pallas-gpu", "pallas-gpu-nosplit"], "tpu": ["pallas-tpu"]}.get(
            platform_name, [])
    return {name: table[name] for name in names}


def time_call(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                         # compile + warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    check_args(args)
    platform_name = jax.default_backend()
    backends = backends_for(platform_name, args.backends, kernel_params(args))
    if args.sweep:
        backends.update(sweep_backends(args))
    pages_per_seq = -(-args.context // args.page_size)
    rows = []
    for batch in args.batches:
        rng = np.random.default_rng(batch)
        num_pages = 1 + batch * pages_per_seq
        shape = (args.kv_heads, num_pages, args.page_size, args.head_dim)
        key_k, key_v, key_q = jax.random.split(jax.random.key(batch), 3)
        cache = (jax.random.normal(key_k, shape, jnp.bfloat16), jax.random.normal(key_v, shape, jnp.bfloat16))
        page_table = jnp.asarray((1 + rng.permutation(num_pages - 1)).reshape(batch, pages_per_seq), jnp.int32)
        lengths = jnp.full((batch,), args.context, jnp.int32)
        q = jax.random.normal(key_q, (batch, args.heads, args.head_dim), jnp.bfloat16)
        kv_bytes = 2 * batch * args.context * args.kv_heads * args.head_dim * 2
        roofline = kv_bytes / args.bandwidth
        outputs = {}
        for name, backend in backends.items():
            step = jax.jit(backend.decode_attention)
            seconds = time_call(step, q, cache, page_table, lengths, repeats=args.repeats)
            outputs[name] = np.asarray(step(q, cache, page_table, lengths), np.float32)
            rows.append(dict(backend=name, batch=batch, context=args.context, seconds=seconds,
                             roofline_seconds=roofline, ratio_to_roofline=seconds / roofline,
                             kv_bytes=kv_bytes, params=pallas_params(backend)
                             if isinstance(backend, PallasGpuBackend) else None))
        base = outputs.get("reference-hnd")
        for row in rows[-len(backends):]:
            row["max_abs_diff_vs_gather"] = (None if base is None else
                                             float(np.abs(outputs[row["backend"]] - base).max()))
        write(args, argv, platform_name, rows)
    print("| backend | batch | µs | roofline µs | × roofline | max |diff| vs gather |\n|---|---|---|---|---|---|")
    for r in rows:
        diff = "" if r["max_abs_diff_vs_gather"] is None else f"{r['max_abs_diff_vs_gather']:.1e}"
        print(f"| {r['backend']} | {r['batch']} | {r['seconds'] * 1e6:.1f} | {r['roofline_seconds'] * 1e6:.1f} | "
              f"{r['ratio_to_roofline']:.2f} | {diff} |")
    return write(args, argv, platform_name, rows)


def write(args, argv, platform_name: str, rows: list) -> dict:
    result = dict(command=" ".join(["python bench/decode_attention.py", *argv]), jax=jax.__version__,
                  platform=platform_name, device=str(jax.devices()[0].device_kind), host=platform.node(),
                  machine=machine_info(),
                  shape=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                             page_size=args.page_size, dtype="bfloat16"), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
