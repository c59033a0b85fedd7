"""Supervised fine-tuning of a model (Qwen3 or Llama) on walkthrough turns: how this project makes a competent teacher
(and a weaker starting student) without downloading a checkpoint.

Owns ``sft_corpus`` (a run config's demonstration turns as samples: which games, which demonstrations, which
thinking; one definition for the SFT run and for the copy warm-up that shares its vocabulary) and ``train_sft``:
the sharded train step with the ``sft`` loss over a seeded, resumable ``SFTDataset`` (``jaxopd.methods.sft_data``),
orbax checkpoints every ``checkpoint_every`` steps (state + data position), per-step metrics (JSONL + TensorBoard)
and optional evaluation every ``eval_every`` steps through the same hook as the distillation loop
(``fn(model, step) -> dict``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from jaxopd_envs.alfworld_names import random_renaming, rename_reference
from jaxopd_envs.base import Task
from jaxopd_envs.references import ReferenceTrajectory
from jaxopd.methods.benchmarks import TRAIN_SPLIT, BenchmarkSource, references_for, subset
from jaxopd.methods.config import SFT_DEMONSTRATIONS, RunConfig
from jaxopd.methods.loop import batch_length
from jaxopd.methods.metrics_log import MetricsWriter
from jaxopd.methods.run_folder import Interrupted, run_folder
from jaxopd.methods.sft_data import (FAST_MODES, FOCUS_TURNS, REWRITTEN_TURNS, SFTDataset, WalkthroughStats,
                                     walkthrough_samples)
from jaxopd.models.decoder import CausalLM
from jaxopd.models.weights import restrict_vocabulary
from jaxopd.tokenizer import SubVocabularyTokenizer, sub_vocabulary
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.checkpoint import TrainCheckpointer
from jaxopd.train.mesh import RolePlan, build_meshes
from jaxopd.train.step import (LossConfig, OptimizerConfig, abstract_train_state, batch_shardings,
                               check_supervised_fit, init_train_state, make_optimizer, make_train_step, place_batch,
                               train_state_shardings)

__all__ = ["SFTCorpus", "sft_corpus", "train_sft", "sft_steps", "corpus_vocabulary", "to_sub_vocabulary"]


@dataclasses.dataclass(frozen=True)
class SFTCorpus:
    """The SFT samples of a run config, with the games they come from and the games left out (task id -> why)."""

    samples: list[Sample]
    stats: WalkthroughStats
    tasks: list[Task]
    references: Mapping[str, ReferenceTrajectory]
    failures: dict[str, str]


def sft_corpus(config: RunConfig, source: BenchmarkSource, tokenizer: Any, *, progress: bool = True
               ) -> SFTCorpus:
    """The demonstration turns of ``config`` (a ``RunConfig``): its seeded subset of the benchmark's training games
    (``train_tasks``), demonstrated by ``sft_demonstrations`` (the searching expert within ``max_turns``), each
    joined by ``sft_renamed_copies`` copies with its classes renamed at random (``jaxopd_envs.alfworld_names``),
    rendered with ``sft_thinking`` under ``max_prompt_tokens``; then ``sft_take_copies`` more renamed copies of the
    turns whose action is ``take`` only, and ``sft_arrival_copies`` of the turns after a ``go to`` or ``open``, each
    renamed afresh (``sft_data.FOCUS_TURNS``: the turns where the answer says whether the goal object is in view, which
    a free-running teacher got wrong), ``sft_change_copies`` of the turns holding the goal object
    still to clean, heat or cool (``FOCUS_TURNS["change"]``); then ``sft_refused_copies`` renamed copies of the turns
    after one more, refused, command (``sft_data.refused_turn``: the same step after "Nothing happens."), and
    ``sft_missing_copies`` of the turns after a refused ``go to`` a receptacle the room lacks
    (``sft_data.missing_turn``); then ``sft_fast_copies`` renamed copies of every turn in each of ActFirst-OPD's
    fast action modes (``sft_data.FAST_MODES``: next-action and inverse-dynamics prompts answered by the action tag
    alone), which a student must serve for ActFirst's rollouts to act; ``sft_action_weight`` weights every sample's
    action tag against its thinking, and ``sft_action_format`` writes it (``rollout.tags.ACTION_FORMATS``). Raises
    ``ValueError`` when no demonstration succeeded."""
    tasks = subset(source.tasks(TRAIN_SPLIT[config.benchmark]), config.train_tasks, seed=config.seed)
    kind = SFT_DEMONSTRATIONS[config.sft_demonstrations]
    failures: dict[str, str] = {}
    references = references_for(source, tasks, workers=min(4, os.cpu_count() or 1), progress=progress, kind=kind,
                                expert_max_turns=config.max_turns if kind == "searching_expert" else None,
                                failures=failures)
    if not references:
        raise ValueError(f"no {config.sft_demonstrations} demonstration of the {len(tasks)} training games "
                         f"succeeded (first reason: {next(iter(failures.values()), '?')})")
    demonstrations = list(references.values())
    def renamed(copy: int) -> list:
        return [rename_reference(reference, random_renaming(reference, seed=config.seed, copy=copy),
                                 tag=f"renamed{copy}") for reference in references.values()]

    for copy in range(1, config.sft_renamed_copies + 1):
        demonstrations += renamed(copy)
    samples, stats = walkthrough_samples(demonstrations, tokenizer, max_prompt_tokens=config.max_prompt_tokens,
                                         benchmark=config.benchmark, thinking=config.sft_thinking,
                                         action_weight=config.sft_action_weight,
                                         action_format=config.sft_action_format)
    copy = config.sft_renamed_copies                     # each further copy gets a renaming no copy before used
    for focus, copies in (("take", config.sft_take_copies), ("arrival", config.sft_arrival_copies),
                          ("change", config.sft_change_copies), ("refused", config.sft_refused_copies),
                          ("missing", config.sft_missing_copies)):
        for _ in range(copies):
            copy += 1
            selection = ({"rewrite": REWRITTEN_TURNS[focus]} if focus in REWRITTEN_TURNS
                         else {"keep": FOCUS_TURNS[focus]})
            more, more_stats = walkthrough_samples(renamed(copy), tokenizer, max_prompt_tokens=config.max_prompt_tokens,
                                                   benchmark=config.benchmark, thinking=config.sft_thinking,
                                                   action_weight=config.sft_action_weight,
                                                   action_format=config.sft_action_format, **selection)
            samples += more
            stats = stats.merged(more_stats)
    for _ in range(config.sft_fast_copies):
        copy += 1
        for mode in FAST_MODES:                          # the same renaming for both modes of a copy
            more, more_stats = walkthrough_samples(renamed(copy), tokenizer, max_prompt_tokens=config.max_prompt_tokens,
                                                   benchmark=config.benchmark, action_weight=config.sft_action_weight,
                                                   mode=mode)
            samples += more
            stats = stats.merged(more_stats)
    return SFTCorpus(samples, stats, list(tasks), references, failures)


def corpus_vocabulary(samples: Sequence[Sample]) -> tuple[int, ...]:
    """The sorted token ids that occur in ``samples``: the sub-vocabulary of the context language-model term."""
    ids = np.unique(np.concatenate([np.asarray(s.tokens, np.int64) for s in samples]))
    return tuple(int(i) for i in ids)


def to_sub_vocabulary(model: CausalLM, samples: Sequence[Sample]) -> tuple[CausalLM, list[Sample], Any]:
    """``model`` (over Qwen3's ids) and ``samples`` (tokenized in them) over the sub-vocabulary of the samples' ids
    (``jaxopd.tokenizer.sub_vocabulary``: those ids, the byte tokens and the added tokens): the cut-down model
    (``weights.restrict_vocabulary``), the samples' tokens renumbered, and the tokenizer that encodes as they now
    are (``SubVocabularyTokenizer``). The model's logits at the kept ids are unchanged; its softmax is over them.
    Qwen3 models only (``ValueError`` otherwise): the token map is of Qwen3's ids, and another family's tokenizer
    numbers its tokens otherwise."""
    if model.config.model_type != "qwen3":
        raise ValueError(f"a sub-vocabulary is a subset of Qwen3's token ids; this is a {model.config.model_type} "
                         "model, whose tokenizer has ids of its own (train it over its full vocabulary)")
    token_map = sub_vocabulary(corpus_vocabulary(samples))
    local = np.full(max(token_map) + 1, -1, np.int64)
    local[list(token_map)] = np.arange(len(token_map))

    def renumber(tokens):
        return local[np.asarray(tokens, np.int64)].astype(np.asarray(tokens).dtype)

    renumbered = [dataclasses.replace(s, tokens=renumber(s.tokens)) for s in samples]
    return restrict_vocabulary(model, token_map), renumbered, SubVocabularyTokenizer(token_map)


def sft_steps(num_samples: int, batch_size: int, epochs: float) -> int:
    """Steps of ``epochs`` passes over ``num_samples`` samples in batches of ``batch_size`` (at least 1)."""
    return max(1, math.ceil(epochs * math.ceil(num_samples / batch_size)))


def train_sft(model: CausalLM, samples: Sequence[Sample], out_dir: str | os.PathLike, *, steps: int, batch_size: int,
              learning_rate: float, weight_decay: float = 0.0, max_grad_norm: float = 1.0, seed: int = 0,
              max_train_tokens: int = 2048, max_supervised_tokens: int | None = 64, context_lm_weight: float = 0.0,
              lr_schedule: str = "constant", group_by_length: int = 0, checkpoint_every: int = 50,
              keep_checkpoints: int = 3,
              eval_every: int = 0, evaluate: Callable[[CausalLM, int], Mapping[str, Any]] | None = None,
              exports: Mapping[int, str | os.PathLike] | None = None, run_config: Mapping[str, Any] | None = None,
              progress: bool = True, tensorboard: bool = True, log: Callable[[str], None] = print) -> CausalLM:
    """Trains ``model`` for ``steps`` steps of ``batch_size`` samples; returns the model with the trained weights.

    ``context_lm_weight`` > 0 adds the language-model term on the prompt tokens (``LossConfig.context_lm_weight``)
    over the corpus vocabulary of ``samples`` (:func:`corpus_vocabulary`). ``lr_schedule="cosine"`` warms the rate up
    over the first 5 % of ``steps`` and decays it to a tenth at ``steps`` (``OptimizerConfig``); a resumed run
    keeps its schedule only when given the same ``steps``. ``group_by_length`` W > 0 batches samples of similar
    length (``SFTDataset``); a resumed run must be given the same W to continue its data order.

    Keeps the newest ``keep_checkpoints`` checkpoints (one every ``checkpoint_every`` steps and the last).
    Resumes from ``out_dir/checkpoints`` when it holds a checkpoint (the data order continues exactly).
    ``evaluate(model, step)`` runs before training (step 0, fresh runs only), every ``eval_every`` steps and at
    the end; its result goes to ``eval.jsonl`` with the training wall-clock (evaluation time excluded).
    ``exports`` maps a step to a folder where the model of that step is written as a Hugging Face folder when the
    run passes it (a weaker student from the same run as its teacher). ``run_config`` (the run's config as a dict)
    is stored in every checkpoint, so a resume is checked against what the checkpoint was trained with.
    The folder is locked for the run; SIGINT / SIGTERM write a checkpoint and raise ``run_folder.Interrupted``.
    """
    if not samples:
        raise ValueError("no SFT samples")
    too_long = [len(s) for s in samples if len(s) > max_train_tokens]
    if too_long:
        raise ValueError(f"{len(too_long)} SFT samples exceed max_train_tokens {max_train_tokens} "
                         f"(longest {max(too_long)}); raise it or lower the prompt budget")
    exports = dict(exports or {})
    bad = [at for at in exports if isinstance(at, bool) or not isinstance(at, int) or not 1 <= at <= steps]
    if bad:
        raise ValueError(f"export steps must lie in [1, {steps}], got {bad}")
    out_dir = Path(out_dir)
    with run_folder(out_dir) as interruption:
        return _train_sft(model, samples, out_dir, interruption, steps=steps, batch_size=batch_size,
                          learning_rate=learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                          seed=seed, max_train_tokens=max_train_tokens, max_supervised_tokens=max_supervised_tokens,
                          context_lm_weight=context_lm_weight, lr_schedule=lr_schedule,
                          group_by_length=group_by_length, checkpoint_every=checkpoint_every,
                          keep_checkpoints=keep_checkpoints, eval_every=eval_every, evaluate=evaluate,
                          exports=exports, run_config=run_config, progress=progress, tensorboard=tensorboard,
                          log=log)


def _train_sft(model: CausalLM, samples: Sequence[Sample], out_dir: Path, interruption: Any, *, steps: int,
               batch_size: int, learning_rate: float, weight_decay: float, max_grad_norm: float, seed: int,
               max_train_tokens: int, max_supervised_tokens: int | None, context_lm_weight: float, lr_schedule: str,
               group_by_length: int, checkpoint_every: int, keep_checkpoints: int, eval_every: int,
               evaluate: Callable[[CausalLM, int], Mapping[str, Any]] | None,
               exports: Mapping[int, str | os.PathLike], run_config: Mapping[str, Any] | None, progress: bool,
               tensorboard: bool, log: Callable[[str], None]) -> CausalLM:
    dataset = SFTDataset(samples, batch_size, seed=seed, group_by_length=group_by_length)
    loss_config = LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=max_supervised_tokens,
                             context_lm_weight=context_lm_weight,
                             context_vocab=corpus_vocabulary(samples) if context_lm_weight > 0 else None)
    if loss_config.context_vocab:
        log(f"context language-model term (weight {context_lm_weight}) over the corpus's "
            f"{len(loss_config.context_vocab):,} token ids")
    meshes = build_meshes(RolePlan.for_device_count(len(jax.devices())))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=learning_rate, weight_decay=weight_decay,
                                               max_grad_norm=max_grad_norm, schedule=lr_schedule,
                                               decay_steps=steps, warmup_steps=steps // 20))
    shardings = train_state_shardings(params, optimizer, meshes.trainer)
    rows = batch_shardings(meshes.trainer)
    train_step = make_train_step(graphdef, optimizer, loss_config, shardings, rows)
    checkpointer = TrainCheckpointer(out_dir / "checkpoints", max_to_keep=keep_checkpoints)
    wall = 0.0
    restored = checkpointer.restore_latest(abstract_train_state(params, optimizer, shardings),
                                           warn=lambda message: log(f"warning: {message}"))
    if restored is not None:
        state, wall = restored.state, float(restored.metadata.get("wall_s", 0.0))
        log(f"resumed SFT at step {restored.step}")
    else:
        state = init_train_state(params, optimizer, shardings)
    step = int(jax.device_get(state.step))
    writer = MetricsWriter(out_dir, tensorboard=tensorboard, resume_step=step)   # drops records past the checkpoint
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=step, desc="sft steps", unit="step")

    def metadata(wall_s: float) -> dict[str, Any]:
        return {"wall_s": wall_s, **({"config": dict(run_config)} if run_config is not None else {})}

    def current_model() -> CausalLM:
        trained = nnx.merge(graphdef, jax.device_get(state.params))
        return trained

    def run_eval(at: int, wall_s: float) -> float:
        t0 = time.perf_counter()
        result = dict(evaluate(current_model(), at))
        writer.write("eval", at, {"wall_s": wall_s, "eval_s": time.perf_counter() - t0, **result})
        return time.perf_counter() - t0

    try:
        if evaluate is not None and step == 0 and not (out_dir / "eval.jsonl").is_file():
            run_eval(0, 0.0)
        start = time.perf_counter() - wall
        epoch, index = dataset.position(step)
        batches = dataset.batches(epoch, index)
        while step < steps:
            batch_samples = next(batches, None)
            if batch_samples is None:
                epoch += 1
                batches = dataset.batches(epoch)
                continue
            host = collate_samples(batch_samples, batch_size=batch_size,
                                   length=batch_length(max(len(s) for s in batch_samples), max_train_tokens))
            check_supervised_fit(host.loss_mask, max_supervised_tokens)
            t0 = time.perf_counter()
            state, metrics = train_step(state, place_batch(host, rows))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            step += 1
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(f"SFT step {step}: non-finite loss {metrics}")
            writer.write("train", step, {**metrics, "step_s": time.perf_counter() - t0, "epoch": epoch,
                                         "wall_s": time.perf_counter() - start})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            saved = step % checkpoint_every == 0 or step == steps
            if saved:
                checkpointer.save(state, metadata=metadata(time.perf_counter() - start))
            if step in exports:
                from jaxopd.models.weights import save_model
                save_model(current_model(), exports[step])
                log(f"exported the step-{step} model to {exports[step]}")
            if evaluate is not None and ((eval_every and step % eval_every == 0) or step == steps):
                start += run_eval(step, time.perf_counter() - start)
            if interruption.requested and step < steps:
                if not saved:
                    checkpointer.save(state, metadata=metadata(time.perf_counter() - start))
                raise Interrupted(interruption.signum, step)
    finally:
        if bar is not None:
            bar.close()
        writer.close()
        checkpointer.close()
    return current_model()
