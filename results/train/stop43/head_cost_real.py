"""The recipe's real SFT step against the same step with its supervised projection restricted to the corpus
vocabulary, side by side on the same grouped batches (stop 43).

Arm "full": ``make_train_step`` with the one-sft recipe's loss (the ``sft`` loss over ``--max-supervised-tokens``
supervised positions per row projected onto all 151,936 ids, and the context term over the corpus vocabulary), as
``bench.sft_step`` builds it. Arm "restricted": the same step after ``jaxopd.train.step._supervised_from_hidden``
is replaced by a copy whose supervised positions are projected onto the corpus vocabulary only
(``Qwen3.head_rows``), the softmax a sub-vocabulary model would have. A what-if timing, not a feature: nothing in
``jaxopd`` changes. Every batch length is compiled for both arms first (arm "full" before the replacement, so its
traces keep the real projection); then the arms alternate step by step on the first ``--steps`` grouped batches of
epoch 0 (seed 0), each arm from its own train state (fresh random weights, then its compile steps).

    python results/train/stop43/head_cost_real.py --steps 8 --out results/train/stop43/head_cost_real.json
"""
import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import jaxopd.train.step as step_module
from bench.common import sft_train_step
from bench.sft_step import corpus
from jaxopd.machine import machine_info
from jaxopd.methods.loop import batch_length
from jaxopd.methods.sft import corpus_vocabulary
from jaxopd.methods.sft_data import SFTDataset
from jaxopd.models.qwen3 import Qwen3, Qwen3Config
from jaxopd.train.buffer import collate_samples
from jaxopd.train.step import LossConfig, place_batch


def restricted_supervised(vocab_ids):
    vocab = jnp.asarray(vocab_ids, jnp.int32)

    def supervised_from_hidden(model, hidden, tokens, loss_mask, max_supervised_tokens, temperature):
        batch, length = tokens.shape
        width = min(int(max_supervised_tokens), length)
        mask = loss_mask.astype(bool)
        order = jnp.argsort(jnp.logical_not(mask), axis=1, stable=True)[:, :width]
        valid = jnp.take_along_axis(mask, order, axis=1)
        context = jnp.take_along_axis(hidden, jnp.maximum(order - 1, 0)[..., None], axis=1)
        index = jnp.full((model.config.vocab_size,), 0, jnp.int32).at[vocab].set(
            jnp.arange(vocab.shape[0], dtype=jnp.int32))
        targets = index[jnp.take_along_axis(tokens, order, axis=1)]
        logits = model.logits(context, head_dv=model.head_rows(vocab))
        values = jnp.where(valid, step_module.token_log_probs(logits, targets, temperature), 0.0)
        rows = jnp.arange(batch)[:, None]
        return jnp.zeros((batch, length), values.dtype).at[rows, order].add(values)

    return supervised_from_hidden


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--max-supervised-tokens", type=int, default=120)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.thinking = "task-tool-act-here"
    config, samples = corpus(args)
    vocab = corpus_vocabulary(samples)
    batches = list(SFTDataset(samples, args.batch_size, seed=0, group_by_length=args.window).batches(0))[:args.steps]
    timed = [collate_samples(b, batch_size=args.batch_size,
                             length=batch_length(max(len(s) for s in b), config.max_train_tokens)) for b in batches]
    loss_config = LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=args.max_supervised_tokens,
                             context_lm_weight=1.0, context_vocab=vocab)
    arms, compile_s = {}, {}
    for name in ("full", "restricted"):
        if name == "restricted":
            step_module._supervised_from_hidden = restricted_supervised(vocab)
        model = Qwen3(Qwen3Config.preset("tiny"), rngs=nnx.Rngs(0))
        train_step, state, rows = sft_train_step(model, loss_config)
        for length in sorted({b.tokens.shape[1] for b in timed}):
            batch = next(b for b in timed if b.tokens.shape[1] == length)
            t0 = time.perf_counter()
            state, metrics = train_step(state, place_batch(batch, rows))   # the step donates its state
            jax.block_until_ready(metrics)
            compile_s[f"{name} {length}"] = time.perf_counter() - t0
            print(f"compiled {name} length {length}: {compile_s[f'{name} {length}']:.1f} s", flush=True)
        arms[name] = [train_step, state, rows]
    seconds = {name: [] for name in arms}
    for index, batch in enumerate(timed):
        for name, arm in arms.items():
            t0 = time.perf_counter()
            arm[1], metrics = arm[0](arm[1], place_batch(batch, arm[2]))
            jax.block_until_ready(metrics)
            seconds[name].append(time.perf_counter() - t0)
        print(f"step {index + 1}/{len(timed)} (length {batch.tokens.shape[1]}): "
              + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()), flush=True)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"median step: full {medians['full']:.2f} s, restricted to {len(vocab)} ids {medians['restricted']:.2f} s; "
          f"full / restricted {medians['full'] / medians['restricted']:.2f}x", flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python results/train/stop43/head_cost_real.py " + " ".join(sys.argv[1:]),
                   "vocabulary": len(vocab), "lengths": [int(b.tokens.shape[1]) for b in timed],
                   "median_step_s": medians, "step_s": seconds, "compile_s": compile_s,
                   "full_over_restricted": medians["full"] / medians["restricted"], "machine": machine_info()},
                  f, indent=1)


if __name__ == "__main__":
    main()
