"""A model over its corpus's sub-vocabulary against the same model over Qwen3's 151,936 ids, side by side: the SFT
train step and the engine's decoding.

The corpus is the teacher recipe's (``bench.sft_step.corpus``: the searching expert's won turns of the generated
ALFWorld training games, ``--thinking``). The full arm is the ``--model`` preset with random weights (seed 0); the
sub-vocabulary arm is the same model cut down by ``jaxopd.methods.sft.to_sub_vocabulary`` (the corpus's ids, the
256 byte tokens and the added tokens), the samples renumbered, so both arms hold the same body and the same
logits at the kept ids.

- SFT step: the same batches (``SFTDataset``, seed 0, grouped by length in windows of ``--window``, as the recipe
  trains), padded as ``train_sft`` pads them, trained by the same jitted step (``make_train_step``, the ``sft``
  loss with the context term over the corpus's ids, ``--max-supervised-tokens`` supervised positions per row).
  Every batch length is compiled first and not timed; then the arms alternate step by step, ``--steps`` each.
- Decoding: ``--requests`` prompts (the first samples' contexts) served at once by ``Engine`` at temperature 1.0,
  each made to decode exactly ``--new-tokens`` tokens (``min_new_tokens``); one untimed round compiles, then the
  arms alternate ``--rounds`` rounds. Reported: generated tokens per second.

Medians are reported with the ratio full / sub-vocabulary (how many times faster the cut-down model is).

    python -m bench.sub_vocabulary --out results/bench/sub_vocabulary.json
"""
from __future__ import annotations

import statistics
import sys
import time

from bench.common import sft_train_step, write_result
from bench.sft_step import corpus
from jaxopd import cli
from jaxopd.machine import machine_info


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.sub_vocabulary", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="jaxopd model preset (random weights; the recipe's is tiny)")
    p.add_argument("--thinking", default="task-tool-act-here", help="SFT thinking of the corpus")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=32, help="group_by_length: batches per sorted window")
    p.add_argument("--steps", type=int, default=12, help="timed SFT steps per arm")
    p.add_argument("--max-supervised-tokens", type=int, default=120)
    p.add_argument("--requests", type=int, default=8, help="decoding: requests served at once")
    p.add_argument("--new-tokens", type=int, default=128, help="decoding: tokens each request decodes")
    p.add_argument("--rounds", type=int, default=3, help="decoding: timed rounds per arm")
    p.add_argument("--out", default="results/bench/sub_vocabulary.json")
    return p.parse_args(argv)


def check_args(args) -> None:
    from jaxopd.methods.config import SFT_THINKING

    cli.check_random_preset("--model", args.model)     # a sub-vocabulary is of Qwen3's ids
    if args.thinking not in SFT_THINKING:
        raise cli.UsageError(f"--thinking {args.thinking!r} is not an SFT thinking; choose one of {SFT_THINKING}")
    for flag in ("batch_size", "window", "steps", "max_supervised_tokens", "requests", "new_tokens", "rounds"):
        if getattr(args, flag) <= 0:
            raise cli.UsageError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    cli.check_out_file("--out", args.out)


def parameter_count(model) -> int:
    import jax
    from flax import nnx
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    import jax
    from flax import nnx

    from jaxopd.methods.loop import batch_length
    from jaxopd.methods.sft import corpus_vocabulary, to_sub_vocabulary
    from jaxopd.methods.sft_data import SFTDataset
    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.sampler.engine import Engine, EngineConfig
    from jaxopd.sampler.types import Request, SamplingParams
    from jaxopd.tokenizer import Qwen3Tokenizer
    from jaxopd.train.buffer import collate_samples
    from jaxopd.train.step import LossConfig, place_batch

    config, samples = corpus(args)
    full = CausalLM(ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    sub, sub_samples, sub_tokenizer = to_sub_vocabulary(full, samples)
    arms = {"full vocabulary": (full, samples, Qwen3Tokenizer()),
            f"sub-vocabulary ({sub.config.vocab_size} ids)": (sub, sub_samples, sub_tokenizer)}
    names = list(arms)

    # SFT step: the same batch indices in both arms (the dataset orders by length and seed only)
    order = [[id(s) for s in b] for b in SFTDataset(samples, args.batch_size, seed=0,
                                                    group_by_length=args.window).batches(0)][:args.steps]
    position = {id(s): i for i, s in enumerate(samples)}
    steps_per_arm = len(order)
    timed, runners = {}, {}
    for name, (model, arm_samples, _) in arms.items():
        def collate(indices, arm_samples=arm_samples):
            batch = [arm_samples[position[i]] for i in indices]
            return collate_samples(batch, batch_size=args.batch_size,
                                   length=batch_length(max(len(s) for s in batch), config.max_train_tokens))
        timed[name] = [collate(b) for b in order]
        loss_config = LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=args.max_supervised_tokens,
                                 context_lm_weight=1.0, context_vocab=corpus_vocabulary(arm_samples))
        runners[name] = list(sft_train_step(model, loss_config))
    compile_s = {name: {} for name in names}
    for name in names:
        step, state, rows = runners[name]
        for batch in timed[name]:
            length = int(batch.tokens.shape[1])
            if length in compile_s[name]:
                continue
            t0 = time.perf_counter()
            state, metrics = step(state, place_batch(batch, rows))
            jax.block_until_ready(metrics)
            compile_s[name][length] = time.perf_counter() - t0
        runners[name][1] = state
    step_s = {name: [] for name in names}
    for index in range(steps_per_arm):
        for name in names:
            step, state, rows = runners[name]
            t0 = time.perf_counter()
            state, metrics = step(state, place_batch(timed[name][index], rows))
            jax.block_until_ready(metrics)
            step_s[name].append(time.perf_counter() - t0)
            runners[name][1] = state
        print(f"SFT step {index + 1}/{steps_per_arm}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in step_s.items()),
              flush=True)

    # decoding: the first samples' contexts, each decoding exactly --new-tokens tokens
    prompts = {name: [list(s.tokens[:int(s.loss_mask.argmax())]) for s in arm_samples[:args.requests]]
               for name, (_, arm_samples, _) in arms.items()}
    longest = max(len(p) for p in prompts[names[0]]) + args.new_tokens
    page = 16
    engine_config = EngineConfig(max_slots=args.requests, page_size=page,
                                 num_pages=args.requests * (-(-longest // page)) + 1,
                                 max_seq_len=-(-longest // page) * page, prefill_chunk=512, max_prefill_tokens=1024,
                                 max_prefill_rows=4)
    params = SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, temperature=1.0)
    engines = {name: Engine(model, engine_config, tokenizer=tokenizer).start()
               for name, (model, _, tokenizer) in arms.items()}
    decode_tps = {name: [] for name in names}
    try:
        for round_index in range(args.rounds + 1):
            for name in names:
                requests = [Request(prompt_ids=p, params=params) for p in prompts[name]]
                t0 = time.perf_counter()
                results = engines[name].generate(requests)
                seconds = time.perf_counter() - t0
                if round_index:              # round 0 compiles
                    decode_tps[name].append(sum(len(r.token_ids) for r in results) / seconds)
            if round_index:
                print(f"decode round {round_index}/{args.rounds}: "
                      + ", ".join(f"{n} {t[-1]:.0f} tokens/s" for n, t in decode_tps.items()), flush=True)
    finally:
        for engine in engines.values():
            engine.stop()

    figures = {name: {"parameters": parameter_count(arms[name][0]), "vocabulary": arms[name][0].config.vocab_size,
                      "median_sft_step_s": statistics.median(step_s[name]), "sft_step_s": step_s[name],
                      "compile_s": compile_s[name], "median_decode_tokens_per_s": statistics.median(decode_tps[name]),
                      "decode_tokens_per_s": decode_tps[name]} for name in names}
    a, b = (figures[n] for n in names)
    result = {"benchmark": "sub_vocabulary", "model": args.model, "thinking": args.thinking, "samples": len(samples),
              "batch_size": args.batch_size, "window": args.window, "steps": steps_per_arm,
              "requests": args.requests, "new_tokens": args.new_tokens, "rounds": args.rounds, "arms": figures,
              "sft_step_speedup": a["median_sft_step_s"] / b["median_sft_step_s"],
              "decode_speedup": b["median_decode_tokens_per_s"] / a["median_decode_tokens_per_s"],
              "machine": machine_info(), "command": "python -m bench.sub_vocabulary " + " ".join(sys.argv[1:])}
    lines = [f"{args.model} preset over its corpus's sub-vocabulary against the full vocabulary ({len(samples):,} "
             f"samples, {args.thinking}); SFT: batch {args.batch_size}, {steps_per_arm} alternating steps per arm; "
             f"decoding: {args.requests} requests x {args.new_tokens} tokens, {args.rounds} alternating rounds", "",
             "| model | vocabulary | parameters | median SFT step s | decoding tokens/s |", "|---|---|---|---|---|"]
    for name, f in figures.items():
        lines.append(f"| {name} | {f['vocabulary']:,} | {f['parameters'] / 1e6:.2f} M | {f['median_sft_step_s']:.2f} | "
                     f"{f['median_decode_tokens_per_s']:.0f} |")
    lines += ["", f"sub-vocabulary: SFT step {result['sft_step_speedup']:.2f}x faster, decoding "
              f"{result['decode_speedup']:.2f}x faster"]
    write_result(result, "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
