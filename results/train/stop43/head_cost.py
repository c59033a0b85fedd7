"""What the tied 151,936-way head costs in an SFT step of the recipe's shape, measured side by side (stop 43).

Stop 42's note proposed a sub-vocabulary model, estimating from FLOPs per token that the head is 93 % of a step.
But the recipe's SFT step projects only the supervised positions (``--max-supervised-tokens 120`` per row) onto
the vocabulary, while the body runs on every prompt token. This measures it: the same jitted AdamW step of the
``tiny`` preset (random weights, float32) on 8 rows of T tokens, its loss the log-softmax of the last 120 positions
(a) over all 151,936 ids, (b) over 342 ids (the corpus vocabulary's size; the head restricted by
``Qwen3.head_rows``), (c) no head at all (the body alone, a squared-norm loss on the same hidden states).
The arms alternate step by step; the median of ``--steps`` steps each is printed and written as JSON.

    python results/train/stop43/head_cost.py --lengths 768 1024 --steps 5 --out results/train/stop43/head_cost.json
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxopd.machine import machine_info
from jaxopd.models.qwen3 import PRESETS, Qwen3, dense_causal_attend

ARMS = ("full head", "342-id head", "no head")


def make_steps(graphdef, batch: int, length: int, supervised: int, vocab: jax.Array):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 0, int(vocab.shape[0]))
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    mask = jnp.ones((batch, length), jnp.int32)
    optimizer = optax.adamw(1e-3)

    def loss(params, arm):
        model = nnx.merge(graphdef, params)
        hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, mask))
        context = hidden[:, -supervised:]
        if arm == "no head":
            return jnp.mean(context * context)
        head = None if arm == "full head" else model.head_rows(vocab)
        logits = model.logits(context, head_dv=head)
        return -jnp.mean(jax.nn.log_softmax(logits, axis=-1)[..., 0])

    def make(arm):
        @jax.jit
        def step(params, state):
            value, grads = jax.value_and_grad(loss)(params, arm)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value
        return step

    return optimizer, {arm: make(arm) for arm in ARMS}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[768, 1024])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--supervised", type=int, default=120)
    p.add_argument("--vocab", type=int, default=342)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = Qwen3(PRESETS["tiny"], rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    vocab = jnp.arange(args.vocab, dtype=jnp.int32)
    rows = []
    for length in args.lengths:
        optimizer, steps = make_steps(graphdef, args.batch_size, length, args.supervised, vocab)
        state = {arm: (params, optimizer.init(params)) for arm in ARMS}
        for arm in ARMS:                                  # compile, untimed
            p_, s_, v = steps[arm](*state[arm])
            v.block_until_ready()
            state[arm] = (p_, s_)
        times = {arm: [] for arm in ARMS}
        for _ in range(args.steps):
            for arm in ARMS:
                t0 = time.perf_counter()
                p_, s_, v = steps[arm](*state[arm])
                v.block_until_ready()
                times[arm].append(time.perf_counter() - t0)
                state[arm] = (p_, s_)
        medians = {arm: statistics.median(times[arm]) for arm in ARMS}
        rows.append({"length": length, "batch": args.batch_size, "supervised_per_row": args.supervised,
                     "median_step_s": medians, "steps_s": times,
                     "full_over_restricted": medians["full head"] / medians["342-id head"]})
        print(f"T={length}: " + ", ".join(f"{arm} {medians[arm]:.2f} s" for arm in ARMS)
              + f"; full / restricted {rows[-1]['full_over_restricted']:.2f}x", flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python results/train/stop43/head_cost.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()), "machine": machine_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
