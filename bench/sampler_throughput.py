"""Generated tokens/s of the jaxopd engine against Hugging Face transformers' ``generate``, side by side.

Same random tiny Qwen3 weights (made by transformers, loaded into jaxopd through the weight port), same
batch sizes, prompt length and fixed output length (min = max new tokens), sampling at temperature 1.
Each measurement is repeated and the median reported; the engine is warmed up (compilation excluded),
transformers gets one untimed warm-up call. Prints a markdown table and writes JSON.

    python bench/sampler_throughput.py --out results/bench/sampler_throughput.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch intra-op threads")
    p.add_argument("--model", default="tiny", help="jaxopd preset name for the architecture")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--out", default="results/bench/sampler_throughput.json")
    return p.parse_args(argv)


def make_checkpoint(preset: str, folder: Path):
    import torch
    from transformers import Qwen3Config as HFConfig, Qwen3ForCausalLM

    from jaxopd.models.qwen3 import Qwen3Config

    cfg = Qwen3Config.preset(preset, dtype="float32")
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(HFConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                      if k not in ("architectures", "model_type", "torch_dtype")})).eval()
    hf.save_pretrained(folder)
    return hf


def bench_transformers(hf, batch, prompts, new_tokens, repeats):
    import torch

    ids = torch.tensor(prompts[:batch])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                  top_p=1.0, top_k=0, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
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


def main(argv=None):
    args = parse_args(argv)
    import jax
    import torch

    from jaxopd.models.weights import load_qwen3
    from jaxopd.sampler import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_checkpoint(args.model, Path(tmp))
        model = load_qwen3(tmp, dtype="float32" if jax.default_backend() == "cpu" else None)
    vocab = model.config.vocab_size
    prompts = rng.integers(0, vocab, size=(max(args.batches), args.prompt_len)).tolist()
    max_batch = max(args.batches)
    seq = args.prompt_len + args.new_tokens
    config = EngineConfig(max_slots=max_batch, page_size=16, num_pages=max_batch * (seq // 16 + 2) + 1,
                          max_seq_len=seq, prefill_chunk=min(512, 1 << (args.prompt_len - 1).bit_length()),
                          max_prefill_tokens=4096, eos_token_ids=())
    rows = []
    with Engine(model, config) as engine:
        t0 = time.perf_counter()
        compiled = engine.warmup()
        warmup_s = time.perf_counter() - t0
        for batch in args.batches:
            # interleave the two systems per batch size so both see the same machine state
            engine_times = bench_engine(engine, batch, prompts, args.new_tokens, args.repeats)
            hf_times = ([] if args.skip_transformers else
                        bench_transformers(hf, batch, prompts, args.new_tokens, args.repeats))
            tokens = batch * args.new_tokens
            e_tps = tokens / statistics.median(engine_times)
            h_tps = tokens / statistics.median(hf_times) if hf_times else float("nan")
            rows.append({"batch": batch, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                         "jaxopd_tokens_per_s": e_tps, "transformers_tokens_per_s": h_tps,
                         "ratio": e_tps / h_tps if hf_times else None,
                         "jaxopd_times_s": engine_times, "transformers_times_s": hf_times})
            print(f"batch {batch:>3}: jaxopd {e_tps:8.1f} tok/s   transformers {h_tps:8.1f} tok/s   "
                  f"ratio {e_tps / h_tps if hf_times else float('nan'):.2f}x", flush=True)
        stats = dict(engine.stats)
    print()
    print(f"| batch | jaxopd tok/s | transformers tok/s | ratio |")
    print(f"|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['jaxopd_tokens_per_s']:.1f} | {r['transformers_tokens_per_s']:.1f} | "
              f"{(r['ratio'] or float('nan')):.2f}x |")
    out = {"rows": rows, "model": args.model, "params": int(sum(np.prod(p.shape) for p in hf.parameters())),
           "backend": jax.default_backend(), "jax": jax.__version__, "torch": torch.__version__,
           "torch_threads": args.threads, "machine": platform.platform(), "cpus": os.cpu_count(),
           "engine_warmup_s": warmup_s, "compiled_variants": compiled, "engine_stats": stats,
           "command": " ".join([sys.executable.split("/")[-1]] + sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    main()
