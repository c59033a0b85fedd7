"""One layer's decode attention, per backend, against the KV-read roofline, at Qwen3's attention shape.

Times ``decode_attention`` of the attention backends (``reference-hnd``'s gather, ``pallas-gpu``'s in-place
kernel with automatic and with no k-splits, ``pallas-tpu`` on a TPU) for one token per row over ``--context``
cached tokens, bfloat16 pages ``[kv_heads, pages, page_size, head_dim]``, page ids shuffled. The roofline is
the bytes the step must read (K and V of every row's context) over ``--bandwidth`` (H200: 4.8 TB/s). Also
checks each backend against the gather (max abs difference). Prints a markdown table and writes JSON.

    python bench/decode_attention.py --out results/bench/decode_attention.json
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
from kernels.paged_attention_reference import HeadsFirstReferenceBackend
from kernels.pallas_gpu import PallasGpuBackend
from kernels.pallas_tpu import PallasTpuBackend


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
                   help="also time pallas-gpu over pages_per_block x num_stages x num_warps")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def sweep_backends():
    return {f"pallas-gpu ppb={ppb} stages={stages} warps={warps}":
            PallasGpuBackend(pages_per_block=ppb, num_stages=stages, num_warps=warps)
            for ppb in (2, 4, 8) for stages in (1, 2, 3) for warps in (4, 8)}


BACKEND_NAMES = ("reference-hnd", "pallas-gpu", "pallas-gpu-nosplit", "pallas-tpu")


def check_args(args) -> None:
    """The input checks, before anything is timed (``jaxopd.cli.UsageError``)."""
    for name in args.backends or ():
        if name not in BACKEND_NAMES:
            raise cli.UsageError(f"--backends {name!r} is not a backend of this bench; choose from "
                                 f"{list(BACKEND_NAMES)}")
    if args.out:
        cli.check_out_file("--out", args.out)


def backends_for(platform_name: str, names):
    table = {"reference-hnd": HeadsFirstReferenceBackend(),
             "pallas-gpu": PallasGpuBackend(),
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
    backends = backends_for(platform_name, args.backends)
    if args.sweep:
        backends.update(sweep_backends())
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
                             kv_bytes=kv_bytes))
        base = outputs.get("reference-hnd")
        for row in rows[-len(backends):]:
            row["max_abs_diff_vs_gather"] = (None if base is None else
                                             float(np.abs(outputs[row["backend"]] - base).max()))
    print("| backend | batch | µs | roofline µs | × roofline | max |diff| vs gather |\n|---|---|---|---|---|---|")
    for r in rows:
        diff = "" if r["max_abs_diff_vs_gather"] is None else f"{r['max_abs_diff_vs_gather']:.1e}"
        print(f"| {r['backend']} | {r['batch']} | {r['seconds'] * 1e6:.1f} | {r['roofline_seconds'] * 1e6:.1f} | "
              f"{r['ratio_to_roofline']:.2f} | {diff} |")
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
