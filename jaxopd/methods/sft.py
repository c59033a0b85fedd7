"""Supervised fine-tuning of a model (Qwen3 or Llama) on demonstration turns: how this project makes a competent
teacher (and a weaker starting student) without downloading a checkpoint.

Owns ``train_sft``: the ``sft`` loss through the same ``Learner`` as distillation (sharded step, orbax checkpoints
every ``checkpoint_every`` steps) over a seeded, resumable ``SFTDataset`` (``jaxopd.methods.sft_data``, which also
builds a run config's corpus), per-step metrics (JSONL + TensorBoard) and optional evaluation every ``eval_every``
steps through the same hook as the distillation loop (``fn(model, step) -> dict``).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from jaxopd.methods.metrics_log import MetricsWriter
from jaxopd.methods.run_folder import Interrupted, run_folder
from jaxopd.methods.sft_data import SFTDataset
from jaxopd.models.decoder import CausalLM
from jaxopd.models.lora import LoraConfig
from jaxopd.sample import Sample
from jaxopd.train.learner import Learner
from jaxopd.train.state import OptimizerConfig
from jaxopd.train.step import LossConfig

__all__ = ["train_sft", "sft_steps"]


def sft_steps(num_samples: int, batch_size: int, epochs: float) -> int:
    """Steps of ``epochs`` passes over ``num_samples`` samples in batches of ``batch_size`` (at least 1)."""
    return max(1, math.ceil(epochs * math.ceil(num_samples / batch_size)))


def train_sft(model: CausalLM, samples: Sequence[Sample], out_dir: str | os.PathLike, *, steps: int, batch_size: int,
              learning_rate: float, weight_decay: float = 0.0, max_grad_norm: float = 1.0, seed: int = 0,
              max_train_tokens: int = 2048, max_supervised_tokens: int | None = 64, lr_schedule: str = "constant",
              group_by_length: int = 0, checkpoint_every: int = 50, keep_checkpoints: int = 3,
              eval_every: int = 0, evaluate: Callable[[CausalLM, int], Mapping[str, Any]] | None = None,
              exports: Mapping[int, str | os.PathLike] | None = None, run_config: Mapping[str, Any] | None = None,
              lora: LoraConfig | None = None, exporter: Callable[[Learner, Path], None] | None = None,
              progress: bool = True, tensorboard: bool = True, log: Callable[[str], None] = print) -> CausalLM:
    """Trains ``model`` for ``steps`` steps of ``batch_size`` samples; returns the model with the trained weights
    (with ``lora``: adapters over the frozen ``model``, fresh from ``seed``; the returned model has them merged).

    ``lr_schedule="cosine"`` warms the rate up over the first 5 % of ``steps`` and decays it to a tenth at ``steps``
    (``OptimizerConfig``); a resumed run keeps its schedule only when given the same ``steps``. ``group_by_length``
    W > 0 batches samples of similar length (``SFTDataset``); a resumed run must be given the same W to continue its
    data order.

    Keeps the newest ``keep_checkpoints`` checkpoints (one every ``checkpoint_every`` steps and the last).
    Resumes from ``out_dir/checkpoints`` when it holds a checkpoint (the data order continues exactly).
    ``evaluate(model, step)`` runs before training (step 0, fresh runs only), every ``eval_every`` steps and at
    the end; its result goes to ``eval.jsonl`` with the training wall-clock (evaluation time excluded).
    ``exports`` maps a step to a folder where the model of that step is written as a Hugging Face folder when the
    run passes it (a weaker student from the same run as its teacher), by ``exporter(learner, folder)`` if given
    (the command line's: LoRA runs write adapter folders). ``run_config`` (the run's config as a dict)
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
        learner = Learner(model, LossConfig(kind="sft", temperature=1.0, max_supervised_tokens=max_supervised_tokens),
                          OptimizerConfig(learning_rate=learning_rate, weight_decay=weight_decay,
                                          max_grad_norm=max_grad_norm, schedule=lr_schedule, decay_steps=steps,
                                          warmup_steps=steps // 20),
                          out_dir / "checkpoints", batch_size=batch_size, max_train_tokens=max_train_tokens,
                          keep_checkpoints=keep_checkpoints, lora=lora, seed=seed, log=log)
        try:
            return _train(learner, SFTDataset(samples, batch_size, seed=seed, group_by_length=group_by_length),
                          out_dir, interruption, steps=steps, checkpoint_every=checkpoint_every,
                          eval_every=eval_every, evaluate=evaluate, exports=exports, run_config=run_config,
                          exporter=exporter or save_whole_model, progress=progress, tensorboard=tensorboard, log=log)
        finally:
            learner.close()


def save_whole_model(learner: Learner, folder: Path) -> None:
    """The default export: the model with the current weights as a Hugging Face folder (in a multi-process run every
    process gathers the weights, process 0 writes them)."""
    from jaxopd.models.weights import save_model
    from jaxopd.train.distributed import is_primary
    model = learner.model()
    if is_primary():
        save_model(model, folder)


def _train(learner: Learner, dataset: SFTDataset, out_dir: Path, interruption: Any, *, steps: int,
           checkpoint_every: int, eval_every: int, evaluate: Callable[[CausalLM, int], Mapping[str, Any]] | None,
           exports: Mapping[int, str | os.PathLike], run_config: Mapping[str, Any] | None,
           exporter: Callable[[Learner, Path], None], progress: bool, tensorboard: bool,
           log: Callable[[str], None]) -> CausalLM:
    """The SFT loop: the next batch of the dataset's order → step → metrics, checkpoint, export, evaluation."""
    restored = learner.restore_or_init()
    wall = 0.0
    if restored is not None:
        wall = float(restored.metadata.get("wall_s", 0.0))
        log(f"resumed SFT at step {restored.step}")
    step = learner.version
    writer = MetricsWriter(out_dir, tensorboard=tensorboard, resume_step=step)   # drops records past the checkpoint
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=step, desc="sft steps", unit="step")

    def metadata(wall_s: float) -> dict[str, Any]:
        return {"wall_s": wall_s, **({"config": dict(run_config)} if run_config is not None else {})}

    def run_eval(at: int, wall_s: float) -> float:
        t0 = time.perf_counter()
        result = dict(evaluate(learner.model(), at))
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
            host = learner.collate(batch_samples)
            t0 = time.perf_counter()
            metrics = learner.step(learner.place(host))
            step = learner.version
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(f"SFT step {step}: non-finite loss {metrics}")
            writer.write("train", step, {**metrics, "step_s": time.perf_counter() - t0, "epoch": epoch,
                                         "wall_s": time.perf_counter() - start})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            saved = step % checkpoint_every == 0 or step == steps
            if saved:
                learner.save(metadata=metadata(time.perf_counter() - start))
            if step in exports:
                exporter(learner, Path(exports[step]))
                log(f"exported the step-{step} model to {exports[step]}")
            if evaluate is not None and ((eval_every and step % eval_every == 0) or step == steps):
                start += run_eval(step, time.perf_counter() - start)
            if interruption.requested and step < steps:
                if not saved:
                    learner.save(metadata=metadata(time.perf_counter() - start))
                raise Interrupted(interruption.signum, step)
    finally:
        if bar is not None:
            bar.close()
        writer.close()
    return learner.model()
