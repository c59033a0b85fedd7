"""SFT train steps on batches grouped by length against the plain shuffled batches, side by side.

The samples are an SFT corpus of the searching expert's
won turns of the generated ALFWorld training games, rendered with ``--thinking`` under a 1,024-token prompt
budget (on a fresh machine the games and the expert's references are made first, about 15 minutes on 2 cores).
Both arms serve the same epoch of ``SFTDataset`` (seed 0, batch ``--batch-size``): ``group_by_length=0`` (plain)
and ``group_by_length=--window``. Each batch is padded as ``train_sft`` pads it (``Learner``'s ``batch_length``: a
multiple of 128 tokens, at most ``max_train_tokens``) and trained by the same jitted step (``make_train_step``
with the ``sft`` loss, its context term over the corpus vocabulary and ``--max-supervised-tokens`` supervised
positions per row). Every batch length either arm uses is compiled first and not timed; then the arms alternate
step by step (so both see the same machine state), ``--steps`` each, and the median step time is reported with
the padded tokens per batch, the share of real tokens and the compiled shapes.

    python -m bench.sft_step --out results/bench/sft_step.json
"""
from __future__ import annotations

import statistics
import sys
import time

from bench.common import sft_train_step, write_result
from jaxopd import cli
from jaxopd.machine import machine_info


def parse_args(argv=None):
    p = cli.Parser(prog="python -m bench.sft_step", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="jaxopd model preset (random weights; the recipe's is tiny)")
    p.add_argument("--thinking", default="plan", help="SFT thinking of the corpus")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=32, help="group_by_length: batches per sorted window")
    p.add_argument("--steps", type=int, default=16, help="timed steps per arm")
    p.add_argument("--max-supervised-tokens", type=int, default=120)
    p.add_argument("--out", default="results/bench/sft_step.json")
    return p.parse_args(argv)


def check_args(args) -> None:
    from jaxopd.methods.config import SFT_THINKING

    cli.check_random_preset("--model", args.model)     # the corpus is tokenized by the offline Qwen3 tokenizer
    if args.thinking not in SFT_THINKING:
        raise cli.UsageError(f"--thinking {args.thinking!r} is not an SFT thinking; choose one of {SFT_THINKING}")
    for flag in ("batch_size", "window", "steps", "max_supervised_tokens"):
        if getattr(args, flag) <= 0:
            raise cli.UsageError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    cli.check_out_file("--out", args.out)


def corpus(args):
    from jaxopd.methods.benchmarks import GeneratedCounts, resolve_source
    from jaxopd.methods.config import build_config
    from jaxopd.methods.sft_data import sft_corpus
    from jaxopd.tokenizer import Qwen3Tokenizer

    config = build_config("sft", preset="cpu", sft_demonstrations="searching-expert", sft_thinking=args.thinking,
                          max_turns=30, batch_size=args.batch_size)
    source = resolve_source(config.benchmark, config.games, counts=GeneratedCounts(), progress=True)
    return config, sft_corpus(config, source, Qwen3Tokenizer(), progress=True).samples


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    import jax
    from flax import nnx

    from jaxopd.methods.sft_data import SFTDataset
    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.train.buffer import collate_samples
    from jaxopd.train.learner import batch_length
    from jaxopd.train.state import place_batch
    from jaxopd.train.step import LossConfig

    config, samples = corpus(args)
    arms = {"plain": SFTDataset(samples, args.batch_size, seed=0),
            f"grouped (window {args.window})": SFTDataset(samples, args.batch_size, seed=0,
                                                          group_by_length=args.window)}
    batches = {name: list(dataset.batches(0)) for name, dataset in arms.items()}
    steps = min(args.steps, min(len(b) for b in batches.values()))

    def collate(batch):
        length = batch_length(max(len(s) for s in batch), config.max_train_tokens)
        return collate_samples(batch, batch_size=args.batch_size, length=length)

    model = CausalLM(ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    loss_config = LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=args.max_supervised_tokens,
                             context_lm_weight=1.0,
                             context_vocab=tuple(sorted({int(t) for s in samples for t in s.tokens})))
    train_step, state, rows = sft_train_step(model, loss_config)

    # the padded batches of the timed steps, and one compile per batch length either arm uses
    timed = {name: [collate(b) for b in arm[:steps]] for name, arm in batches.items()}
    shapes = sorted({batch.tokens.shape[1] for arm in timed.values() for batch in arm})
    compile_s = {}
    for length in shapes:
        batch = next(b for arm in timed.values() for b in arm if b.tokens.shape[1] == length)
        t0 = time.perf_counter()
        state, metrics = train_step(state, place_batch(batch, rows))
        jax.block_until_ready(metrics)
        compile_s[length] = time.perf_counter() - t0
        print(f"compiled length {length}: {compile_s[length]:.1f} s", flush=True)

    seconds = {name: [] for name in timed}
    for index in range(steps):
        for name, arm in timed.items():
            t0 = time.perf_counter()
            state, metrics = train_step(state, place_batch(arm[index], rows))
            jax.block_until_ready(metrics)
            seconds[name].append(time.perf_counter() - t0)
        print(f"step {index + 1}/{steps}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()), flush=True)

    figures = {}
    for name, arm in timed.items():
        real = sum(int(b.attention_mask.sum()) for b in arm)
        padded = sum(int(b.tokens.size) for b in arm)
        figures[name] = {"median_step_s": statistics.median(seconds[name]), "step_s": seconds[name],
                         "padded_tokens_per_batch": padded / steps, "real_share": real / padded,
                         "lengths": sorted({int(b.tokens.shape[1]) for b in arm})}
    whole_epoch = {name: sum(args.batch_size * batch_length(max(len(s) for s in b), config.max_train_tokens)
                             for b in arm) for name, arm in batches.items()}
    plain, grouped = figures.values()
    result = {"benchmark": "sft_step", "model": args.model, "thinking": args.thinking, "samples": len(samples),
              "batch_size": args.batch_size, "window": args.window, "steps": steps,
              "max_supervised_tokens": args.max_supervised_tokens, "compile_s": compile_s, "arms": figures,
              "padded_tokens_whole_epoch": whole_epoch,
              "step_ratio_grouped_over_plain": grouped["median_step_s"] / plain["median_step_s"],
              "machine": machine_info(),
              "command": "python -m bench.sft_step " + " ".join(sys.argv[1:])}
    lines = [f"SFT step, {args.model} preset, {len(samples):,} samples ({args.thinking}), batch {args.batch_size}, "
             f"{steps} alternating steps per arm", "",
             "| batches | median step s | padded tokens per batch | real tokens | batch lengths |",
             "|---|---|---|---|---|"]
    for name, f in figures.items():
        lines.append(f"| {name} | {f['median_step_s']:.2f} | {f['padded_tokens_per_batch']:,.0f} | "
                     f"{f['real_share']:.1%} | {', '.join(map(str, f['lengths']))} |")
    epoch_ratio = list(whole_epoch.values())[1] / list(whole_epoch.values())[0]
    lines += ["", f"grouped / plain step time: {result['step_ratio_grouped_over_plain']:.3f}; padded tokens over the "
              f"whole epoch: {epoch_ratio:.3f}; one compile per length: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in compile_s.items())]
    write_result(result, "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
