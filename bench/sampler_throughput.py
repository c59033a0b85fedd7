"""Generated tokens/s of the jaxopd engine against Hugging Face transformers' ``generate``, side by side.

Same random tiny Qwen3 weights (made by transformers, loaded into jaxopd through the weight port), same
batch sizes, prompt length and fixed output length (min = max new tokens), sampling at temperature 1.
``--model`` a catalogue name of ``jaxopd.models.pretrained.PRETRAINED`` (``smollm2-135m-instruct``), or
``--model-dir DIR``: both sides use that fetched model's float32 weights instead (transformers
``AutoModelForCausalLM.from_pretrained``, jaxopd ``load_model``); the prompts stay random token ids.
Each measurement is repeated and the median reported; the engine is warmed up (compilation excluded),
transformers gets one untimed warm-up call. Prints a markdown table and writes JSON.

    python bench/sampler_throughput.py --out results/bench/sampler_throughput.json
    python bench/sampler_throughput.py --model smollm2-135m-instruct --batches 1 8 32 64 \
        --out results/bench/sampler_throughput_smollm2.json

On a GPU (no transformers side): ``--model qwen3-1.7b --random-init --dtype bfloat16 --skip-transformers
--backend pallas-gpu reference`` times each attention backend, and reports each decode step against the
memory roofline ``(weight bytes + KV bytes read) / --bandwidth`` (H200: 4.8 TB/s) with the device-idle share of
the decode steps (timestamps around dispatch and readiness, ``bench.engine_overhead.StepClock``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):   # run as a script (python bench/NAME.py): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxopd import cli  # noqa: E402
from jaxopd.machine import machine_info  # noqa: E402


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.sampler_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, nargs="+", default=[3],
                   help="timed runs per batch size and system (median reported): one count for all, or one per "
                        "--batches entry (e.g. 3 3 2 1: the large batches of a 135M model cost minutes per run)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch intra-op threads")
    p.add_argument("--model", default="tiny",
                   help="a jaxopd architecture preset (random weights made by transformers), or a catalogue model "
                        "of jaxopd.models.pretrained (its fetched weights: python -m experiments.fetch_model NAME)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="a Hugging Face folder of a Qwen3 or Llama model: its weights on both sides "
                        "(overrides --model)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--random-init", action="store_true",
                   help="build the jaxopd model at random (no transformers checkpoint; implies --skip-transformers)")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--backend", nargs="+", default=None,
                   help="attention backends to time (default: the platform's, kernels.default_backend_name())")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth in bytes/s for the roofline")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile only the shapes used (one untimed run per batch) instead of every bucket")
    p.add_argument("--out", default="results/bench/sampler_throughput.json")
    return p.parse_args(argv)


def make_checkpoint(preset: str, folder: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from jaxopd.models.decoder import ModelConfig

    cfg = ModelConfig.preset(preset, dtype="float32")
    hf_config, hf_class = ((LlamaConfig, LlamaForCausalLM) if cfg.model_type == "llama"
                           else (Qwen3Config, Qwen3ForCausalLM))
    torch.manual_seed(0)
    hf = hf_class(hf_config(**{k: v for k, v in cfg.to_hf_dict().items()
                               if k not in ("architectures", "model_type", "torch_dtype")})).eval()
    hf.save_pretrained(folder)
    return hf


def load_transformers(folder: Path):
    """The Hugging Face model of ``folder`` in float32, for ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def model_folder(args) -> Path | None:
    """The folder whose weights both sides use (``--model-dir``, or a fetched catalogue ``--model``); None for an
    architecture preset (random weights)."""
    if args.model_dir:
        return Path(args.model_dir).expanduser()
    from jaxopd.models.pretrained import PRETRAINED, resolve_model_dir

    return resolve_model_dir(args.model) if args.model in PRETRAINED else None


def bench_transformers(hf, batch, prompts, new_tokens, repeats):
    import torch

    ids = torch.tensor(prompts[:batch])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                  top_p=1.0, top_k=0, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        # one untimed warm-up call (its first 8 prompt tokens, 2 new ones): torch compiles nothing, and a full-length
        # warm-up would cost as much as a timed call (minutes for a 135M model at batch 64 on 2 cores)
        hf.generate(ids[:, :8], **{**kwargs, "attention_mask": torch.ones_like(ids[:, :8]), "max_new_tokens": 2,
                                   "min_new_tokens": 2})
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf.generate(ids, **kwargs)
            times.append(time.perf_counter() - t0)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return times


def bench_engine(engine, batch, prompts, new_tokens, repeats):
    from jaxopd.sampler import Request, SamplingParams

    times = []
    for r in range(repeats):
        requests = [Request(prompts[i], SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                       temperature=1.0, seed=r * 1000 + i))
                    for i in range(batch)]
        t0 = time.perf_counter()
        results = engine.generate(requests)
        times.append(time.perf_counter() - t0)
        assert all(len(res.token_ids) == new_tokens for res in results)
    return times


def roofline_seconds(cfg, weight_bytes: int, batch: int, context: float, bandwidth: float) -> float:
    """Bytes one decode step must read (all weights once, K and V of every row's context) over the bandwidth."""
    kv_bytes = batch * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * context * np.dtype(cfg.dtype).itemsize
    return (weight_bytes + kv_bytes) / bandwidth


def decode_step_stats(records, batch_rows: int) -> dict:
    """Median device time and idle share of the decode steps that ran with ``batch_rows`` padded rows."""
    rows = np.asarray([r for r in records if r[3] == batch_rows])
    if len(rows) < 3:
        return {"decode_step_s": float("nan"), "decode_idle_share": float("nan")}
    start, end, ready = rows[:, 0], rows[:, 1], rows[:, 2]
    prev_ready = np.concatenate([[end[0]], ready[:-1]])
    device = ready - np.maximum(end, prev_ready)
    return {"decode_step_s": float(np.median(device[1:])),
            "decode_wall_s": float(np.median(np.diff(start))),
            "decode_idle_share": float(1.0 - device[1:].sum() / (ready[-1] - ready[0]))}


def check_args(args) -> None:
    """The input checks, before any model is built (``jaxopd.cli.UsageError``)."""
    if args.model_dir:
        cli.check_checkpoint_folder("--model-dir", args.model_dir)
    else:
        from jaxopd.models.decoder import PRESETS
        from jaxopd.models.pretrained import PRETRAINED

        if args.model in PRETRAINED:
            with cli.usage_errors():
                model_folder(args)      # fetched? (else the fetch command)
        elif args.model.lower().replace("_", "-") not in PRESETS:
            raise cli.UsageError(f"--model {args.model!r} is neither an architecture preset {sorted(PRESETS)} nor "
                                 f"a catalogue model {sorted(PRETRAINED)}")
    if args.backend:
        from jaxopd_kernels import registry as kernels
        choices = [kernels.AUTO, *kernels.available_backends()]
        for name in args.backend:
            if name not in choices:
                raise cli.UsageError(f"--backend {name!r} is not an attention backend; choose one of {choices}")
    if len(args.repeats) not in (1, len(args.batches)) or min(args.repeats) < 1:
        raise cli.UsageError(f"--repeats takes one count >= 1 or one per --batches entry ({len(args.batches)}), got "
                             f"{args.repeats}")
    cli.check_out_file("--out", args.out)


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    import jax
    from flax import nnx

    from jaxopd_kernels import registry as kernels
    from bench.engine_overhead import StepClock
    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.sampler import Engine, EngineConfig
    from jaxopd.sampler import executor as executor_module
    from jaxopd.sampler.buckets import bucket

    skip_hf = args.skip_transformers or args.random_init
    torch = None
    if not skip_hf:
        import torch
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    hf = None
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else None)
    folder = model_folder(args)
    if folder is not None:
        from jaxopd.models.weights import load_model, read_config
        if args.random_init:
            model = CausalLM(read_config(folder, dtype=dtype), rngs=nnx.Rngs(0))
        else:
            model = load_model(folder, dtype=dtype)
            hf = None if skip_hf else load_transformers(folder)
    elif args.random_init:
        model = CausalLM(ModelConfig.preset(args.model, dtype=dtype), rngs=nnx.Rngs(0))
    else:
        from jaxopd.models.weights import load_model
        with tempfile.TemporaryDirectory() as tmp:
            hf = make_checkpoint(args.model, Path(tmp))
            model = load_model(tmp, dtype=dtype)
    cfg = model.config
    weight_bytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model))))
    vocab = cfg.vocab_size
    prompts = rng.integers(0, vocab, size=(max(args.batches), args.prompt_len)).tolist()
    max_batch = max(args.batches)
    seq = args.prompt_len + args.new_tokens
    backends = args.backend or [kernels.default_backend_name()]
    rows = []
    stats = {}
    compiled = {}
    warmup_s = {}
    with StepClock(executor_module) as clock:
        for backend in backends:
            config = EngineConfig(max_slots=max_batch, page_size=16, num_pages=max_batch * (seq // 16 + 2) + 1,
                                  max_seq_len=seq, prefill_chunk=min(512, 1 << (args.prompt_len - 1).bit_length()),
                                  max_prefill_tokens=4096, eos_token_ids=(), attention_backend=backend,
                                  scoring=False)   # generation only: warm-up compiles no scoring step
            with Engine(model, config) as engine:
                t0 = time.perf_counter()
                compiled[backend] = None if args.no_warmup else engine.warmup()
                warmup_s[backend] = time.perf_counter() - t0
                for batch, repeats in zip(args.batches, args.repeats * len(args.batches)
                                          if len(args.repeats) == 1 else args.repeats):
                    if args.no_warmup:
                        bench_engine(engine, batch, prompts, args.new_tokens, 1)    # compiles this size's shapes
                    clock.reset()
                    load_before = os.getloadavg()[0]
                    # interleave the two systems per batch size so both see the same machine state
                    engine_times = bench_engine(engine, batch, prompts, args.new_tokens, repeats)
                    clock.wait()
                    step = decode_step_stats(clock.records, bucket(batch, engine.buckets.decode_rows))
                    hf_times = ([] if skip_hf else
                                bench_transformers(hf, batch, prompts, args.new_tokens, repeats))
                    tokens = batch * args.new_tokens
                    e_tps = tokens / statistics.median(engine_times)
                    h_tps = tokens / statistics.median(hf_times) if hf_times else float("nan")
                    roof = roofline_seconds(cfg, weight_bytes, batch, args.prompt_len + args.new_tokens / 2,
                                            args.bandwidth)
                    rows.append({"backend": backend, "batch": batch, "new_tokens": args.new_tokens,
                                 "prompt_len": args.prompt_len, "repeats": repeats, "jaxopd_tokens_per_s": e_tps,
                                 "transformers_tokens_per_s": h_tps, "ratio": e_tps / h_tps if hf_times else None,
                                 **step, "roofline_s": roof,
                                 "step_over_roofline": step["decode_step_s"] / roof,
                                 "jaxopd_times_s": engine_times, "transformers_times_s": hf_times,
                                 "load_average_1min": [load_before, os.getloadavg()[0]]})
                    print(f"{backend} batch {batch:>3}: jaxopd {e_tps:8.1f} tok/s   transformers {h_tps:8.1f} tok/s"
                          f"   ratio {e_tps / h_tps if hf_times else float('nan'):.2f}x   decode step "
                          f"{1e3 * step['decode_step_s']:.3f} ms = {step['decode_step_s'] / roof:.2f}x roofline, "
                          f"idle {100 * step['decode_idle_share']:.1f}%", flush=True)
                    write_results(args, rows, cfg, model, weight_bytes, torch, warmup_s, compiled, stats,
                                  quiet=True)    # partial results survive a time limit
                stats[backend] = dict(engine.stats)
    print()
    print("| backend | batch | jaxopd tok/s | transformers tok/s | ratio | decode step ms | x roofline | device idle |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['batch']} | {r['jaxopd_tokens_per_s']:.1f} | "
              f"{r['transformers_tokens_per_s']:.1f} | {(r['ratio'] or float('nan')):.2f}x | "
              f"{1e3 * r['decode_step_s']:.3f} | {r['step_over_roofline']:.2f} | "
              f"{100 * r['decode_idle_share']:.1f}% |")
    return write_results(args, rows, cfg, model, weight_bytes, torch, warmup_s, compiled, stats)


def write_results(args, rows, cfg, model, weight_bytes, torch, warmup_s, compiled, stats, quiet=False):
    import jax
    from flax import nnx

    folder = model_folder(args)
    weights = ("random (jaxopd)" if args.random_init else
               "random (transformers, seed 0)" if folder is None else str(folder))
    out = {"rows": rows, "model": args.model_dir or args.model, "model_type": cfg.model_type, "weights": weights,
           "vocab_size": cfg.vocab_size, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
           "dtype": cfg.dtype, "weight_bytes": weight_bytes,
           "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model)))),
           "torch": getattr(torch, "__version__", None), "torch_threads": args.threads,
           "machine": machine_info(), "bandwidth": args.bandwidth,
           "engine_warmup_s": warmup_s, "compiled_variants": compiled, "engine_stats": stats,
           "command": " ".join([sys.executable.split("/")[-1]] + sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if not quiet:
        print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
