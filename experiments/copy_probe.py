"""Does a Qwen3 preset learn in-context copying from random weights, and after how many steps?

Copying a name from the prompt (the task's object, a receptacle in view, an admissible action) is the first skill
an ALFWorld agent needs, and the CPU teacher SFT'd from random weights never showed it (results/train). This
experiment isolates that skill. Each sequence is ``A F A``: ``A`` is ``--length`` random ids, ``F`` is 0 to
``--filler`` random ids, all drawn uniformly from a ``--vocab``-id sub-vocabulary. The loss is the language-model
loss on every position, as in SFT's prompt term. Only the second copy of ``A`` can be predicted (after its first
token, by finding the earlier occurrence and reading the next id: an induction head). Chance is ln(vocab) nats.
With ``--filler 0`` the copy sits at a fixed offset, so one positional head suffices: a control. ``--rows multi``
trains on rows of ``--width`` ids instead, built of ``--length``-id segments of which about half copy an earlier span
0 to ``--filler`` ids back: every row holds many copies, at the long distances of real prompts, for the cost of one.
``--rows recent`` asks which earlier occurrence to copy: a key id is followed by different spans ``--decoys`` times
far back and once within ``--filler`` ids, and the recall copies the most recent span (the choice the CPU teacher
got wrong between its thinking and the admissible list's ``take`` lines, results/train stop 40; stop 41 found the
cause in the tokenizer's spelling of the action's verb and repaired it with ``train --sft-action-format said``).

Training is the SFT path's arithmetic: AdamW (weight decay 0, clip 1.0), the softmax restricted to the
sub-vocabulary (``jaxopd.train.step.context_log_probs``). Rows of the tied embedding outside the sub-vocabulary
get no gradient under that softmax and, with weight decay 0, never change. So the model is built with only the
sub-vocabulary's rows of a randomly initialised preset: the same updates, without carrying 151,936 rows through
every optimizer step.

As a warm-up for SFT: ``--vocab-from-sft`` takes the sub-vocabulary to be the token ids of the teacher's SFT corpus
(``jaxopd.methods.sft.sft_corpus``), ``--init DIR`` starts from a Hugging Face folder (a previous stage), and
``--export DIR`` writes the trained model back as one, its trained rows scattered into the full embedding (the
other rows are the starting model's, unchanged), for ``experiments.train --method sft --student DIR``.

    python -m experiments.copy_probe --steps 6000 --filler 32 --out results/copy_probe/filler32-6000.json

Writes JSON (every evaluation), a markdown table beside it and a PNG of the second copy's loss against the step.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxopd.cli import (Parser, UsageError, check_checkpoint_folder, check_out_dir, check_out_file, command_line,
                        run_main)
from jaxopd.machine import machine_info
from jaxopd.methods.config import SFT_DEMONSTRATIONS, SFT_THINKING

__all__ = ["copy_batch", "multi_copy_batch", "recent_copy_batch", "main"]


def copy_batch(rng: np.random.Generator, batch: int, length: int, filler: int, vocab: int, *,
               fixed_filler: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, mask, second)``, each ``[batch, 2 * length + filler]``: rows ``A F A`` (right-padded with id 0,
    ``mask`` False there); ``second`` is True on the positions of the second copy after its first id (those an
    induction head predicts). ``fixed_filler`` gives every row that filler length (held-out evaluation)."""
    width = 2 * length + filler
    tokens = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), bool)
    second = np.zeros((batch, width), bool)
    for row in range(batch):
        gap = int(rng.integers(0, filler + 1)) if fixed_filler is None else int(fixed_filler)
        copy = rng.integers(0, vocab, length)
        sequence = np.concatenate([copy, rng.integers(0, vocab, gap), copy])
        tokens[row, :len(sequence)] = sequence
        mask[row, :len(sequence)] = True
        second[row, length + gap + 1:len(sequence)] = True
    return tokens, mask, second


def multi_copy_batch(rng: np.random.Generator, batch: int, width: int, length: int, max_gap: int, vocab: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, mask, second)``, each ``[batch, width]``: every row is ``width // length`` segments of ``length``
    ids (the rest of the row fresh ids); the first is fresh, each later one with probability 1/2 copies the
    ``length`` ids that end 0 to ``max_gap`` ids before it (any start, so it may overlap earlier copies), else is
    fresh. ``second`` is True on a copy's positions after its first id."""
    tokens = rng.integers(0, vocab, (batch, width)).astype(np.int32)
    second = np.zeros((batch, width), bool)
    for row in range(batch):
        for start in range(length, width - length + 1, length):
            if rng.random() < 0.5:
                gap = int(rng.integers(0, min(max_gap, start - length) + 1))
                source = start - gap - length
                tokens[row, start:start + length] = tokens[row, source:source + length]
                second[row, start + 1:start + length] = True
    return tokens, np.ones((batch, width), bool), second


def recent_copy_batch(rng: np.random.Generator, batch: int, width: int, length: int, max_gap: int, vocab: int,
                      decoys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, mask, second)``, each ``[batch, width]``: rows of ``width // length`` segments of ``length`` ids
    (``length`` >= 2), some of them recalls. A recall segment is a key id and the ``length - 1`` ids that followed
    the key's most recent earlier occurrence: a *source* segment (the key, then fresh ids) ending 0 to ``max_gap``
    ids before the recall. ``decoys`` segments before the source also start with the key, each followed by fresh
    ids whose first differs from the source's. Each segment from the ``decoys + 1``-th on becomes a recall with
    probability 1/2 when a source and decoys are still free. A key occurs nowhere else in its row, and no id
    outside a key's segments is a key. ``second`` is True on a recall's positions after its key (those only the
    most recent occurrence predicts)."""
    if length < 2:
        raise ValueError(f"recall segments need length >= 2 (a key and its span), got {length}")
    if decoys < 0:
        raise ValueError(f"decoys must be >= 0, got {decoys}")
    segments = width // length
    most_keys = max(1, segments // (decoys + 2))
    if vocab < most_keys + 2:
        raise ValueError(f"a vocabulary of {vocab} ids is too small for {most_keys} keys and their spans")
    tokens = np.zeros((batch, width), np.int32)
    second = np.zeros((batch, width), bool)
    for row in range(batch):
        keys = rng.choice(vocab, most_keys, replace=False)
        others = np.setdiff1d(np.arange(vocab), keys)
        tokens[row] = rng.choice(others, width)
        free = np.ones(segments, bool)
        used = 0
        for recall in range(decoys + 1, segments):
            if used == most_keys or not free[recall] or rng.random() >= 0.5:
                continue
            lowest = max(decoys, recall - 1 - max_gap // length)
            sources = [t for t in range(lowest, recall) if free[t] and free[:t].sum() >= decoys]
            if not sources:
                continue
            source = int(rng.choice(sources))
            fakes = rng.choice(np.flatnonzero(free[:source]), decoys, replace=False)
            key = keys[used]
            used += 1
            span = rng.choice(others, length - 1)
            for fake in fakes:
                decoy = rng.choice(others, length - 1)
                while decoy[0] == span[0]:
                    decoy[0] = rng.choice(others)
                tokens[row, fake * length:(fake + 1) * length] = [key, *decoy]
            tokens[row, source * length:(source + 1) * length] = [key, *span]
            tokens[row, recall * length:(recall + 1) * length] = [key, *span]
            second[row, recall * length + 1:(recall + 1) * length] = True
            free[[source, recall, *fakes]] = False
    return tokens, np.ones((batch, width), bool), second


def sft_vocabulary(args: Any) -> tuple[int, ...]:
    """The token ids of the teacher's SFT corpus (the cpu preset's prompts, ``args``' demonstrations and thinking)."""
    from jaxopd.methods.benchmarks import GeneratedCounts, resolve_source
    from jaxopd.methods.config import build_config
    from jaxopd.methods.sft import corpus_vocabulary, sft_corpus
    from jaxopd.tokenizer import load_tokenizer

    config = build_config("sft", preset="cpu", sft_demonstrations=args.sft_demonstrations,
                          sft_thinking=args.sft_thinking, max_turns=args.max_turns)
    source = resolve_source("alfworld", "generated", counts=GeneratedCounts(), progress=False)
    try:
        corpus = sft_corpus(config, source, load_tokenizer(args.init), progress=False)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return corpus_vocabulary(corpus.samples)


def starting_model(args: Any):
    """The full starting model: ``--init``'s folder, or the preset randomly initialised at ``--seed``."""
    from flax import nnx

    from jaxopd.models.decoder import CausalLM, ModelConfig
    from jaxopd.models.weights import CheckpointError, load_model

    if args.init is None:
        return CausalLM(ModelConfig.preset(args.preset), rngs=nnx.Rngs(args.seed))
    try:
        return load_model(args.init)
    except (CheckpointError, OSError, ValueError) as error:
        raise UsageError(f"--init {args.init!r}: {error}") from None


def scatter_rows(model: Any, embedding_vd: Any, lm_head_dv: Any, rows: np.ndarray) -> Any:
    """``model`` (carrying only the embedding rows ``rows``) made full again: its rows scattered into
    ``embedding_vd`` (and the untied ``lm_head_dv``'s columns), every other row as given; the body untouched."""
    import jax.numpy as jnp
    from flax import nnx

    model.embedding_vd = nnx.Param(jnp.asarray(embedding_vd).at[rows].set(model.embedding_vd[...]))
    if lm_head_dv is not None:
        model.lm_head_dv = nnx.Param(jnp.asarray(lm_head_dv).at[:, rows].set(model.lm_head_dv[...]))
    return model


def run(args: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxopd.models.decoder import dense_causal_attend

    model = starting_model(args)
    config = model.config
    if args.vocab_ids is not None:
        rows = np.asarray(args.vocab_ids, np.int64)
        if rows.max() >= config.vocab_size:
            raise UsageError(f"the SFT corpus holds token id {int(rows.max())}, outside the model's vocabulary of "
                             f"{config.vocab_size}")
    else:
        rows = np.sort(np.random.default_rng(args.seed).choice(config.vocab_size, args.vocab, replace=False))
    full_embedding = model.embedding_vd[...]
    full_head = None if config.tie_word_embeddings else model.lm_head_dv[...]
    model.embedding_vd = nnx.Param(full_embedding[rows])
    if full_head is not None:
        model.lm_head_dv = nnx.Param(full_head[:, rows])
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.learning_rate, weight_decay=0.0))
    opt_state = optimizer.init(params)

    def loss_fn(params, tokens, mask, second):
        m = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        hidden, _ = m.hidden_states(tokens, positions, dense_causal_attend(positions, mask))
        logp = jax.nn.log_softmax(m.logits(hidden[:, :-1]), axis=-1)
        token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        valid = (mask[:, 1:] & mask[:, :-1]).astype(jnp.float32)
        copied = second[:, 1:].astype(jnp.float32)
        hits = (jnp.argmax(logp, axis=-1) == tokens[:, 1:]).astype(jnp.float32)
        loss = -(token_logp * valid).sum() / valid.sum()
        return loss, {"second_nll": -(token_logp * copied).sum() / copied.sum(),
                      "second_accuracy": (hits * copied).sum() / copied.sum()}

    @jax.jit
    def step(params, opt_state, tokens, mask, second):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask, second)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    evaluate = jax.jit(lambda params, *batch: loss_fn(params, *batch)[1])
    held_out_rng = np.random.default_rng(args.seed + 1)
    gaps = sorted(set(args.held_out_gaps or (args.filler, 4 * args.filler)))
    held_out = {gap: copy_batch(held_out_rng, 32, args.length, gap, args.vocab, fixed_filler=gap) for gap in gaps}
    if args.rows == "recent":
        held_out["recent"] = recent_copy_batch(held_out_rng, 8, args.width, args.length, args.filler, args.vocab,
                                               args.decoys)

    def train_batch():
        if args.rows == "multi":
            return multi_copy_batch(rng, args.batch_size, args.width, args.length, args.filler, args.vocab)
        if args.rows == "recent":
            return recent_copy_batch(rng, args.batch_size, args.width, args.length, args.filler, args.vocab,
                                     args.decoys)
        return copy_batch(rng, args.batch_size, args.length, args.filler, args.vocab)

    rng = np.random.default_rng(args.seed)
    every = max(1, args.steps // args.evaluations)
    records: list[dict[str, Any]] = []
    from tqdm import tqdm
    started = time.perf_counter()
    for at in tqdm(range(1, args.steps + 1), desc="copy probe", unit="step", disable=args.no_progress):
        params, opt_state, metrics = step(params, opt_state, *train_batch())
        if at % every == 0 or at == args.steps:
            record = {"step": at, "wall_s": time.perf_counter() - started,
                      **{k: float(v) for k, v in jax.device_get(metrics).items()}}
            for gap, batch in held_out.items():
                result = jax.device_get(evaluate(params, *batch))
                name = "recent" if gap == "recent" else f"gap{gap}"
                record[f"held_out_{name}_nll"] = float(result["second_nll"])
                record[f"held_out_{name}_accuracy"] = float(result["second_accuracy"])
            records.append(record)
    if args.export:
        from jaxopd.models.weights import save_model
        save_model(scatter_rows(nnx.merge(graphdef, params), full_embedding, full_head, rows), args.export)
    return {"command": args.command, "machine": machine_info(),
            "settings": {k: getattr(args, k) for k in ("preset", "steps", "batch_size", "learning_rate", "length",
                                                         "filler", "vocab", "seed", "rows", "width", "decoys",
                                                         "init", "export")},
            "vocabulary": "the SFT corpus's token ids" if args.vocab_ids is not None else "random ids",
            "chance_nll": float(np.log(args.vocab)), "held_out_gaps": gaps, "records": records}


def table(result: dict[str, Any]) -> str:
    gaps = result["held_out_gaps"]
    recent = "held_out_recent_nll" in (result["records"] or [{}])[0]
    head = ["step", "wall (s)", "train loss", "2nd copy NLL"] + [f"held-out NLL / acc, gap {g}" for g in gaps]
    if recent:
        head.append("held-out recall NLL / acc")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["records"]:
        cells = [str(r["step"]), f"{r['wall_s']:.0f}", f"{r['loss']:.3f}", f"{r['second_nll']:.3f}"]
        cells += [f"{r[f'held_out_gap{g}_nll']:.3f} / {r[f'held_out_gap{g}_accuracy']:.1%}" for g in gaps]
        if recent:
            cells.append(f"{r['held_out_recent_nll']:.3f} / {r['held_out_recent_accuracy']:.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    s = result["settings"]
    rows = {"multi": f"rows of {s.get('width')} ids, about half copies 0–{s['filler']} back",
            "recent": f"rows of {s.get('width')} ids, recalls of the most recent of {s.get('decoys')} + 1 spans "
                      f"after one key, the right one 0–{s['filler']} back"}.get(s.get("rows"),
                                                                               f"filler 0–{s['filler']}")
    lines.append(f"\nChance: ln {s['vocab']} = {result['chance_nll']:.3f} nats. Preset {s['preset']}, batch "
                 f"{s['batch_size']}, lr {s['learning_rate']}, copy length {s['length']}, {rows}"
                 + (f", from `{s['init']}`" if s.get("init") else "") + ".")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in result["records"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["second_nll"] for r in result["records"]], label="second copy (train batches)")
    for gap in result["held_out_gaps"]:
        ax.plot(steps, [r[f"held_out_gap{gap}_nll"] for r in result["records"]], label=f"held out, gap {gap}")
    ax.axhline(result["chance_nll"], color="grey", linestyle="--", label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel("NLL of the copied ids (nats)")
    ax.set_title(f"in-context copying, {result['settings']['preset']} preset from random weights")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m experiments.copy_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="Qwen3 architecture (default tiny)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="default: the SFT learning rate")
    parser.add_argument("--length", type=int, default=16, help="ids per copy")
    parser.add_argument("--filler", type=int, default=32, help="most random ids between the copies (0: control)")
    parser.add_argument("--vocab", type=int, default=298, help="sub-vocabulary size (default: the SFT corpus's)")
    parser.add_argument("--rows", default="pair", choices=("pair", "multi", "recent"),
                        help="pair: A F A rows; multi: --width ids of segments, half of them copies; recent: "
                             "--width ids of segments, recalls of a key's most recent span among --decoys others")
    parser.add_argument("--decoys", type=int, default=2, help="recent rows: earlier spans after the same key")
    parser.add_argument("--width", type=int, default=1024, help="ids per multi row")
    parser.add_argument("--held-out-gaps", type=int, nargs="+", default=None,
                        help="gaps of the held-out A F A rows (default: --filler and 4 x --filler)")
    parser.add_argument("--vocab-from-sft", action="store_true",
                        help="sub-vocabulary: the token ids of the teacher's SFT corpus (overrides --vocab)")
    parser.add_argument("--sft-demonstrations", default="searching-expert", choices=SFT_DEMONSTRATIONS)
    parser.add_argument("--sft-thinking", default="state", choices=SFT_THINKING)
    parser.add_argument("--max-turns", type=int, default=30, help="the searching expert's turn limit")
    parser.add_argument("--init", default=None, metavar="DIR", help="start from this Hugging Face folder")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="write the trained model here as a Hugging Face folder (full vocabulary)")
    parser.add_argument("--evaluations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default="results/copy_probe/copy_probe.json")
    args = parser.parse_args(argv)

    def body() -> int:
        for flag in ("steps", "batch_size", "length", "evaluations"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        if args.filler < 0:
            raise UsageError(f"--filler must be >= 0, got {args.filler}")
        if args.vocab < 2:
            raise UsageError(f"--vocab must be >= 2, got {args.vocab}")
        if args.rows == "multi" and args.width < 2 * args.length:
            raise UsageError(f"--width must be >= 2 x --length ({2 * args.length}), got {args.width}")
        if args.rows == "recent":
            if args.length < 2:
                raise UsageError(f"--rows recent needs --length >= 2 (a key and its span), got {args.length}")
            if args.decoys < 0:
                raise UsageError(f"--decoys must be >= 0, got {args.decoys}")
            if args.width < (args.decoys + 3) * args.length:
                raise UsageError(f"--width must hold --decoys + 3 segments ({(args.decoys + 3) * args.length} ids), "
                                 f"got {args.width}")
        if any(gap < 0 for gap in args.held_out_gaps or ()):
            raise UsageError(f"--held-out-gaps must be >= 0, got {args.held_out_gaps}")
        if args.init is not None:
            check_checkpoint_folder("--init", args.init)
        if args.export is not None:
            check_out_dir("--export", args.export)
        if not args.learning_rate > 0:
            raise UsageError(f"--learning-rate must be > 0, got {args.learning_rate}")
        out = check_out_file("--out", args.out)
        args.command = command_line(parser.prog, argv)
        args.vocab_ids = None
        if args.vocab_from_sft:
            args.vocab_ids = sft_vocabulary(args)
            args.vocab = len(args.vocab_ids)
            print(f"sub-vocabulary: the {args.vocab} token ids of the SFT corpus", flush=True)
        result = run(args)
        text = table(result)
        print(text)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(text)
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")
        return 0

    return run_main(body)


if __name__ == "__main__":
    raise SystemExit(main())
