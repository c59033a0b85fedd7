"""Mixed steps (prefill and decode in one device step) against separate prefill and decode steps, side by side.

The workload is the one mixed steps are for, the main job's: more requests than slots, so whenever a row
finishes a new prompt is admitted and prefilled while the other rows decode. Requests have staggered output
lengths (``--new-tokens`` spread over a factor of 4) and prompts of ``--prompt-len`` tokens; all are submitted
at once, so the schedule is deterministic and the same for every repeat. Both engines are built and warmed
up first; then the repeats alternate between them (so both see the same machine state), and the median is
reported: wall time, device calls (a mixed step is one call for its prefill and decode halves), the mixed
share of steps, and generated tokens per second. Decoding is greedy, and the outputs of the two engines are
compared: requests with identical tokens, and the largest log-prob difference over the tokens before a
request's first difference. (A changed batch composition changes float rounding, about 1e-6 here; with
sampling at temperature 1 over a random model's nearly flat 151k-token distribution, that flips a sampled
token now and then and the rest of the request diverges, which says nothing about the step.)

    python -m bench.mixed_steps --out results/bench/mixed_steps.json
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import numpy as np

from bench.common import write_result
from jaxopd import cli
from jaxopd.machine import machine_info


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.mixed_steps", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="jaxopd model preset (random weights)")
    p.add_argument("--backend", default="auto", help="attention backend (auto: the platform's default)")
    p.add_argument("--slots", type=int, default=16, help="max_slots = concurrency (b_max)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64, help="the longest output; others are 1/4 to all of it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/bench/mixed_steps.json")
    return p.parse_args(argv)


def check_args(args) -> None:
    cli.check_model_preset("--model", args.model)
    from jaxopd_kernels import registry as kernels
    choices = [kernels.AUTO, *kernels.available_backends()]
    if args.backend not in choices:
        raise cli.UsageError(f"--backend {args.backend!r} is not an attention backend; choose one of {choices}")
    for flag in ("slots", "requests", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, flag) <= 0:
            raise cli.UsageError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    cli.check_out_file("--out", args.out)


def make_requests(args, vocab: int):
    from jaxopd.sampler import Request, SamplingParams

    rng = np.random.default_rng(0)
    lengths = rng.integers(max(1, args.new_tokens // 4), args.new_tokens + 1, size=args.requests)
    return [Request(rng.integers(0, vocab, size=args.prompt_len).tolist(),
                    SamplingParams(max_new_tokens=int(n), min_new_tokens=int(n), temperature=0.0, seed=i),
                    request_id=f"r{i}") for i, n in enumerate(lengths)]


def run_once(engine, requests):
    before = dict(engine.stats)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - t0
    stats = {k: engine.stats[k] - before[k] for k in engine.stats}
    calls = stats["prefill_steps"] + stats["decode_steps"] - stats["mixed_steps"]
    return results, {"seconds": seconds, "device_calls": calls, "mixed_steps": stats["mixed_steps"],
                     "engine_steps": stats["steps"], "tokens": stats["generated_tokens"]}


def compare(a_results, b_results) -> tuple[int, float]:
    """Requests whose tokens are identical, and the largest log-prob difference over the tokens before each
    request's first difference."""
    same, worst = 0, 0.0
    for a, b in zip(a_results, b_results):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 min(len(a.token_ids), len(b.token_ids)))
        same += a.token_ids == b.token_ids
        worst = max(worst, float(np.max(np.abs(a.logprobs[:n] - b.logprobs[:n]), initial=0.0)))
    return same, worst


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    import jax
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.sampler import Engine, EngineConfig

    dtype = "float32" if jax.default_backend() == "cpu" else None
    model = CausalLM(ModelConfig.preset(args.model, dtype=dtype), rngs=nnx.Rngs(0))
    requests = make_requests(args, model.config.vocab_size)
    seq = args.prompt_len + args.new_tokens
    base = EngineConfig(max_slots=args.slots, page_size=16, num_pages=args.slots * (seq // 16 + 2) + 1,
                        max_seq_len=seq, prefill_chunk=min(512, 1 << (args.prompt_len - 1).bit_length()),
                        max_prefill_tokens=2048, eos_token_ids=(), attention_backend=args.backend, scoring=False)
    names = ("separate", "mixed")
    engines = {name: Engine(model, dataclasses.replace(base, mixed_steps=name == "mixed")).start()
               for name in names}
    try:
        warmup = {}
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.warmup()
            warmup[name] = time.perf_counter() - t0
        runs = {name: [] for name in names}
        outputs = {}
        for _ in range(args.repeats):
            for name in names:
                outputs[name], figures = run_once(engines[name], requests)
                runs[name].append(figures)
                print(f"{name:>8}: {figures['seconds']:.2f} s, {figures['device_calls']} device calls, "
                      f"{figures['mixed_steps']} mixed", flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    same, worst = compare(outputs["separate"], outputs["mixed"])
    same_tokens = same == len(requests)
    summary = {}
    for name in names:
        median = statistics.median(r["seconds"] for r in runs[name])
        first = runs[name][0]
        summary[name] = {"median_s": median, "tokens_per_s": first["tokens"] / median,
                         "device_calls": first["device_calls"], "mixed_steps": first["mixed_steps"],
                         "engine_steps": first["engine_steps"], "warmup_s": warmup[name]}
    ratio = summary["separate"]["median_s"] / summary["mixed"]["median_s"]
    result = {"summary": summary, "runs": runs, "speedup": ratio, "same_tokens": same_tokens,
              "requests_with_same_tokens": same,
              "max_abs_logprob_diff": worst, "args": vars(args), "backend": engines["mixed"].config.backend_name,
              "machine": machine_info(),
              "command": " ".join(["python -m bench.mixed_steps"] + sys.argv[1:])}
    lines = [f"Mixed vs separate steps: `{args.model}` (random weights), backend `{result['backend']}`, "
             f"{args.requests} requests of {args.prompt_len} prompt tokens and {args.new_tokens // 4}-"
             f"{args.new_tokens} new tokens, {args.slots} slots, median of {args.repeats} alternating repeats.",
             "", "| steps | wall s | tok/s | device calls | mixed steps | engine steps |", "|---|---|---|---|---|---|"]
    for name in names:
        s = summary[name]
        lines.append(f"| {name} | {s['median_s']:.2f} | {s['tokens_per_s']:.1f} | {s['device_calls']} | "
                     f"{s['mixed_steps']} | {s['engine_steps']} |")
    lines += ["", f"Speedup of mixed steps: {ratio:.2f}x (separate / mixed wall time). Greedy tokens identical "
              f"on {same} of {len(requests)} requests; largest log-prob difference {worst:.2e}.", ""]
    write_result(result, "\n".join(lines), args.out)
    return 0 if same_tokens else 1


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
