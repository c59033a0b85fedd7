"""The training loop shared by every distillation method, as the papers write it: samples from the rollout source
into a FIFO buffer (version lag <= 1), teacher scoring, the sharded update, the new weights pushed to the rollout
engine, then metrics, evaluation and checkpoints.

Owns ``Trainer``: the set-up of a run (the ``Learner``, the engines, the environment pool, the method's strategy
and its ``SampleSource``) and its loop. The source (``jaxopd.methods.sources``) is the method's and the config's:
asynchronous runner threads streaming episodes, synchronous waves in task order (``rollout_mode="sync"``), or
ActionOPD's collection steps, each trained for one epoch of minibatches (its App. A.4). ActFirst-OPD's reference
trajectories are built as the run first draws their tasks (``jaxopd_envs.references.LazyReferences``, cached across
runs).

Checkpoints (orbax: train state + buffer + counters) are written every ``checkpoint_every`` updates at the moment
the next batch is already buffered, so a resumed run takes exactly the batch an uninterrupted one would have
taken: the next loss is the same. Rollouts that were in flight when a run stopped are replayed from the task
cursor on resume, and the metrics written after the checkpoint are rewound. A sync run, killed and resumed any
number of times, gives the same losses as an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxopd_envs.base import Task
from jaxopd_envs.references import LazyReferences
from jaxopd.methods import registry
from jaxopd.methods.base import Method, RolloutResources
from jaxopd.methods.benchmarks import TRAIN_SPLIT, BenchmarkSource, lazy_references_for, subset
from jaxopd.methods.config import RunConfig
from jaxopd.methods.metrics_log import MetricsWriter, read_jsonl
from jaxopd.methods.run_folder import CONFIG_FILE, Interrupted, check_and_save_config, run_folder
from jaxopd.methods.sources import Counters, SampleSource, TaskStream, make_source
from jaxopd.models.decoder import CausalLM
from jaxopd.rollout.scoring import EngineTeacherScorer
from jaxopd.rollout.trajectory import Trajectory, rollout_quality
from jaxopd.sampler.engine import Engine, EngineConfig, fine_length_step
from jaxopd.sampler.types import Request, SamplingParams
from jaxopd.sample import Sample
from jaxopd.train import distributed
from jaxopd.train.buffer import SampleBuffer
from jaxopd.train.learner import Learner
from jaxopd.train.state import OptimizerConfig

__all__ = ["Trainer", "engine_config_for", "CONFIG_FILE", "check_and_save_config"]


def engine_config_for(config: RunConfig, method: Method, *, scoring: bool = False) -> EngineConfig:
    """An engine that holds every concurrent request of the run at its longest without preemption: the training
    rollouts' (``rollout_slots`` episodes, each with its concurrent requests) and the evaluations' (``rollout_slots``
    episodes under the ``eval_*`` limits), which the same engine serves in turn. The teacher's engine
    (``scoring``) serves training only."""
    page = config.page_size
    train_longest = config.max_prompt_tokens + max(config.total_tokens, config.fast_action_tokens) + 8
    eval_longest = 0 if scoring else config.eval_max_prompt_tokens + config.eval_total_tokens + 8
    train_pages, eval_pages = math.ceil(train_longest / page), math.ceil(eval_longest / page)
    max_seq_len = max(train_pages, eval_pages) * page
    per_episode = {"actionopd": config.num_candidates + config.num_teacher_samples}.get(method.name, 2)
    slots = max(2, config.rollout_slots * per_episode)
    pages = max(slots * train_pages, max(2, config.rollout_slots) * eval_pages)
    chunk = min(512, max_seq_len)
    return EngineConfig(max_slots=slots, page_size=page, num_pages=pages + 1,
                        max_seq_len=max_seq_len, prefill_chunk=chunk, max_prefill_tokens=max(chunk, 1024),
                        max_prefill_rows=4, prefix_sharing=config.prefix_sharing, scoring=scoring,
                        prefill_length_step=fine_length_step(chunk))


class Trainer:
    """One training run (see the module docstring). Build it with the student and teacher models (``CausalLM``
    modules of either family that share the tokenizer), the tokenizer, the task source and an output directory;
    ``run()`` trains ``config.updates`` steps (optimizer updates; ActionOPD: collection steps, each one epoch of
    minibatch updates) and returns the summary. A directory with checkpoints is resumed.

    ``evaluate``: optional ``fn(engine, update) -> dict`` called with the student's rollout engine (current
    weights) before training, every ``eval_every`` updates and at the end; its result is logged as ``eval``.
    ``tasks`` / ``references`` override the training tasks (default: the source's train split, a
    ``train_tasks`` subset) and their references.
    ``on_phase``: optional ``fn(phase, update)`` told when the loop enters ``rollout`` (samples for ``update``),
    ``checkpoint`` / ``saved`` (around the write of the checkpoint of ``update``) and ``step`` (the update
    itself); for progress monitors and the kill-and-resume tests.
    """

    def __init__(self, config: RunConfig, *, student: CausalLM, teacher: CausalLM | None, tokenizer: Any,
                 source: BenchmarkSource, out_dir: str | os.PathLike, progress: bool = True,
                 evaluate: Callable[[Any, int], Mapping[str, Any]] | None = None,
                 tasks: Sequence[Task] | None = None, references: Mapping[str, Any] | None = None,
                 tensorboard: bool = True, log: Callable[[str], None] = print,
                 on_phase: Callable[[str, int], None] | None = None):
        self.config = config
        self.method = registry.make_method(config)
        if config.method == "sft":
            raise ValueError("the sft method trains on walkthroughs: use jaxopd.methods.sft.train_sft")
        # multi-process (jaxopd.train.distributed): every process plays its share of each wave and holds the same
        # buffer; process 0 alone writes the folder's files, logs and shows progress
        self.primary = distributed.is_primary()
        if distributed.is_multiprocess():
            if config.rollout_mode != "sync" and not self.method.trains_in_collections:
                raise ValueError("a multi-process run plays synchronous waves: use "
                                 "--rollout-mode sync (asynchronous runners are single-process for now)")
            if evaluate is not None:
                raise ValueError("a multi-process run evaluates after training (python -m experiments.evaluate on "
                                 "its export); in-training evaluation is single-process")
            if not self.primary:
                progress, tensorboard, log = False, False, (lambda message: None)
        if teacher is None and (self.method.uses_teacher_engine or self.method.loss_config().needs_teacher_logp):
            raise ValueError(f"{config.method} needs a teacher model")
        if teacher is not None and teacher.config.vocab_size != student.config.vocab_size:
            raise ValueError(f"the teacher's vocabulary ({teacher.config.vocab_size}) differs from the student's "
                             f"({student.config.vocab_size}); OPD compares their log-probabilities token by token")
        self.student, self.teacher, self.tokenizer, self.source = student, teacher, tokenizer, source
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.evaluate_fn = evaluate
        self.log = log
        self._tasks_override = list(tasks) if tasks is not None else None
        self._references_override = references
        self._tensorboard = tensorboard
        self._on_phase = on_phase
        self.learner: Learner | None = None
        self.samples: SampleSource | None = None
        self.engine = self.teacher_engine = self.strategy = self.references = None
        self._pool = self._writer = self._bar = None

    @property
    def state(self) -> Any:
        """The current train state (for evaluation hooks and exports)."""
        return self.learner.state

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Trains to ``config.updates`` and returns the summary: the papers' loop, samples → buffer (lag <= 1) →
        teacher scoring → step → weights to the rollout engine → metrics, evaluation, checkpoints. The folder is
        locked for the run (a second process is refused); SIGINT / SIGTERM write a checkpoint and raise
        ``run_folder.Interrupted``."""
        with run_folder(self.out_dir) as self._interruption, contextlib.ExitStack() as stack:
            stack.callback(self._close)
            buffer = self._set_up()
            config, learner, source = self.config, self.learner, self.samples
            counters, version = source.counters, learner.version
            wall_start = time.perf_counter() - counters.wall_s
            last_saved = version
            while not source.finished(version, buffer):
                timings: dict[str, float] = {}
                # 1. samples from the source until the buffer holds the next batch
                t0 = time.perf_counter()
                self._phase("rollout", version + 1)
                source.fill(buffer, version,
                            wait=functools.partial(self._stop_if_interrupted, buffer, version, wall_start))
                self._advance(source.steps(version))
                timings["rollout_s"] = time.perf_counter() - t0
                if buffer.available(version) == 0:      # ActionOPD's collection steps are done
                    break
                # 2. checkpoint with the next batch buffered: a resumed run takes the same batch
                if version % config.checkpoint_every == 0 and version != last_saved:
                    t0 = time.perf_counter()
                    self._save(buffer, version, wall_start)
                    last_saved = version
                    timings["checkpoint_s"] = time.perf_counter() - t0
                # 3. teacher scoring and the update (ActionOPD's epoch ends on a smaller minibatch, padded)
                samples = buffer.take(config.batch_size, version, allow_partial=self.method.trains_in_collections)
                host_batch = learner.collate(samples)
                t0 = time.perf_counter()
                batch = learner.place(host_batch)
                timings["scoring_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self._phase("step", version + 1)
                metrics = learner.step(batch)
                version = learner.version
                timings["step_s"] = time.perf_counter() - t0
                # 4. the new weights to the rollout engine
                t0 = time.perf_counter()
                learner.push(self.engine)
                self.strategy.policy_version = version
                timings["sync_s"] = time.perf_counter() - t0
                if config.sync_check:
                    timings.update(self._check_sync(samples[0], version))
                source.taken(buffer, version)       # the batch left the buffer, and the version moved on
                # 5. metrics, evaluation
                record = {**metrics, **timings, **self._batch_stats(samples, host_batch, version),
                          **self._rollout_stats(source.take_played()), "wall_s": time.perf_counter() - wall_start,
                          "buffer": len(buffer), "dropped_stale": buffer.stats.dropped_stale,
                          "dropped_too_long": source.too_long, "episodes": counters.episodes,
                          "failed_episodes": counters.failed_episodes, **source.record(samples)}
                if isinstance(self.references, LazyReferences):     # references this process built / read
                    record.update(references_built=self.references.built, references_read=self.references.read)
                if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
                    raise FloatingPointError(f"update {version}: non-finite loss or gradient {metrics}")
                self._writer.write("train", version, record)
                self._advance(source.steps(version), loss=f"{metrics['loss']:.4f}", buffer=len(buffer))
                last = source.finished(version, buffer)
                if self.evaluate_fn is not None and config.eval_every and version % config.eval_every == 0 and not last:
                    wall_start += self._evaluate(version, wall_start)
                if not last:
                    self._stop_if_interrupted(buffer, version, wall_start)
            counters.wall_s = time.perf_counter() - wall_start
            source.pause()
            if version != last_saved:
                self._save(buffer, version)
            if self.evaluate_fn is not None and not self._has_eval(version):
                self._evaluate(version, wall_start, wall_s=counters.wall_s)
            return {"updates": version, "collections": counters.collections, "wall_s": counters.wall_s,
                    "episodes": counters.episodes, "failed_episodes": counters.failed_episodes,
                    "dropped_stale": buffer.stats.dropped_stale, "out_dir": str(self.out_dir)}

    # ------------------------------------------------------------------ set-up and tear-down
    def _set_up(self) -> SampleBuffer:
        """The config checked and saved, the learner restored (or fresh), the engines started with its weights,
        the method's strategy and sample source; returns the sample buffer (a resumed run's own)."""
        config, method = self.config, self.method
        check_and_save_config(self.out_dir, config, write=self.primary)
        self.log(f"run config ({config.method} on {config.benchmark}, preset {config.preset}):\n{config.describe()}")
        loss_config = method.loss_config()
        self.learner = Learner(self.student, loss_config,
                               OptimizerConfig(learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                                               max_grad_norm=config.max_grad_norm),
                               self.out_dir / "checkpoints", batch_size=config.batch_size,
                               max_train_tokens=config.max_train_tokens, keep_checkpoints=config.keep_checkpoints,
                               teacher=self.teacher if loss_config.needs_teacher_logp else None,
                               lora=config.lora_config(), seed=config.seed, log=self.log)
        counters, buffer = Counters(), SampleBuffer(config.max_version_lag)
        restored = self.learner.restore_or_init()
        if restored is not None:
            buffer = restored.buffer or buffer
            counters.load(restored.metadata)
            self.log(f"resumed from the checkpoint of update {restored.step} ({len(buffer)} buffered samples, "
                     f"task cursor {counters.cursor})")
        version = self.learner.version
        tasks = self._tasks_override if self._tasks_override is not None else subset(
            self.source.tasks(TRAIN_SPLIT[config.benchmark]), config.train_tasks, seed=config.seed)
        if not tasks:
            raise ValueError("no training tasks")
        self.references = self._references_override
        if method.needs_references and self.references is None:   # built as the run draws their tasks
            self.references = lazy_references_for(self.source, tasks)

        from jaxopd_envs.pool import EnvPool
        self.engine = Engine(self.student, engine_config_for(config, method), tokenizer=self.tokenizer,
                             policy_version=version)
        if method.uses_teacher_engine:
            self.teacher_engine = Engine(self.teacher, engine_config_for(config, method, scoring=True),
                                         tokenizer=self.tokenizer)
        self._pool = EnvPool(self.source.env_factory, config.rollout_slots)
        # every record after the restored update (or after update 0 of a run that never wrote a checkpoint) was
        # written by a run that stopped before saving it, and will be written again
        self._writer = (MetricsWriter(self.out_dir, tensorboard=self._tensorboard, resume_step=version) if self.primary
                        else _NoWriter())
        self.engine.start()
        if self.teacher_engine is not None:
            self.teacher_engine.start()
        if version > 0:     # the engine serves the restored student
            self.learner.push(self.engine)
        self.strategy = method.build_strategy(RolloutResources(
            engine=self.engine, pool=self._pool, tokenizer=self.tokenizer, teacher_engine=self.teacher_engine,
            teacher_scorer=(EngineTeacherScorer(self.teacher_engine, temperature=loss_config.temperature)
                            if self.teacher_engine is not None else None),
            references=self.references))
        self.strategy.policy_version = version
        if self.evaluate_fn is not None and version == 0 and not (self.out_dir / "eval.jsonl").is_file():
            self._writer.write("eval", 0, {"wall_s": 0.0, **self.evaluate_fn(self.engine, 0)})
        self.samples = make_source(method, config, self.strategy, TaskStream(tasks, config.seed, self.references,
                                                                             self.log), counters)
        if self.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=config.updates, initial=self.samples.steps(version), unit=self.samples.unit,
                             desc=f"{config.method} {self.samples.progress_label}")
        self.samples.start(buffer, version)
        return buffer

    def _close(self) -> None:
        """The engines first: episodes still in flight (an interrupted or failed run) then end at once."""
        for engine in (self.engine, self.teacher_engine):
            if engine is not None:
                engine.stop()
        if self.samples is not None:
            self.samples.close()
        if isinstance(self.references, LazyReferences):
            self.references.close()
        for part in (self._bar, self._writer, self.learner, self._pool):
            if part is not None:
                part.close()

    # ------------------------------------------------------------------ helpers
    def _phase(self, phase: str, update: int) -> None:
        if self._on_phase is not None:
            self._on_phase(phase, update)

    def _advance(self, steps: int, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(steps - self._bar.n)
            if postfix:
                self._bar.set_postfix(**postfix)

    def _save(self, buffer: SampleBuffer, version: int, wall_start: float | None = None) -> None:
        """A checkpoint of ``version``: the state, the buffer and the counters, with the run's config (what a resume
        is checked against)."""
        counters = self.samples.checkpoint_counters()
        if wall_start is not None:
            counters.wall_s = time.perf_counter() - wall_start
        self._phase("checkpoint", version)
        self.learner.save(buffer, {**counters.as_dict(), "config": self.config.to_dict()})
        self._phase("saved", version)

    def _stop_if_interrupted(self, buffer: SampleBuffer, version: int, wall_start: float) -> None:
        """After SIGINT / SIGTERM: a checkpoint of the state, the buffer and the task cursor (episodes in flight
        are replayed on resume), then ``Interrupted``."""
        signum = self._interruption.signum
        if distributed.is_multiprocess():       # all processes stop at the same point, each with a checkpoint part
            signals = [s for s in distributed.allgather_objects(signum) if s is not None]
            signum = signum if signum is not None else (signals[0] if signals else None)
        if signum is not None:
            self._save(buffer, version, wall_start)
            raise Interrupted(signum, version)

    def _check_sync(self, sample: Sample, version: int) -> dict[str, Any]:
        """``--sync-check``: the rollout engine decodes the greedy first token of ``sample``'s context (every process
        its own engine, the results all-gathered). ``RuntimeError`` when the engines' tokens differ or one still
        serves another version than ``version``; else the token and its log-probability for the metrics."""
        context = [int(t) for t in sample.tokens[:int(np.argmax(np.asarray(sample.loss_mask)))]]
        probe = Request(prompt_ids=context, params=SamplingParams(max_new_tokens=1, temperature=0.0),
                        request_id=f"sync-check-{version}")
        result = self.engine.submit(probe).result()
        if result.error is not None:
            raise RuntimeError(f"weight sync check after update {version}: the probe request failed: {result.error}")
        mine = (int(result.token_ids[0]), float(result.logprobs[0]), result.policy_versions)
        everyone = distributed.allgather_objects(mine) if distributed.is_multiprocess() else [mine]
        stale = [p for p, (_, _, versions) in enumerate(everyone) if versions is not None
                 and tuple(versions) != (version, version)]
        if stale or len({token for token, _, _ in everyone}) > 1:
            raise RuntimeError(f"weight sync check after update {version}: the rollout engines' greedy first tokens "
                               f"are {[t for t, _, _ in everyone]} and their versions "
                               f"{[v for _, _, v in everyone]} (process order); expected one token at version "
                               f"{version} on every engine")
        return {"sync_check_token": everyone[0][0], "sync_check_logprob": everyone[0][1]}

    @staticmethod
    def _batch_stats(samples: Sequence[Sample], batch: Any, version: int) -> dict[str, float]:
        mask = np.asarray(batch.loss_mask)
        teacher = np.asarray(batch.teacher_generated) & mask
        lags = [version - 1 - s.policy_version for s in samples]
        # which tokens the update trained on, and where: equal digests, equal batches (a reproducible run's check)
        digest = zlib.crc32(np.ascontiguousarray(np.asarray(batch.tokens), dtype=np.int32).tobytes())
        digest = zlib.crc32(np.packbits(mask).tobytes(), digest)
        return {"batch_samples": len(samples), "batch_tokens": int(mask.sum()), "batch_digest": digest,
                "teacher_token_fraction_batch": float(teacher.sum() / max(1, mask.sum())),
                "version_lag_mean": float(np.mean(lags)), "version_lag_max": int(np.max(lags))}

    @staticmethod
    def _rollout_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
        if not trajectories:
            return {}
        quality = rollout_quality(trajectories)
        sources: dict[str, int] = {}
        for trajectory in trajectories:
            for turn in trajectory.turns:
                sources[turn.action_source] = sources.get(turn.action_source, 0) + 1
        turns = max(1, sum(sources.values()))
        stats = {"rollout_episodes": len(trajectories),
                 "rollout_success_rate": float(np.mean([t.won for t in trajectories])),
                 "rollout_mean_turns": float(np.mean([t.num_turns for t in trajectories]))}
        stats.update({f"rollout_{name}": float(value) for name, value in dataclasses.asdict(quality).items()
                      if isinstance(value, (int, float)) and not isinstance(value, bool)})
        stats.update({f"action_source_{name}": count / turns for name, count in sorted(sources.items())})
        guided = [turn for trajectory in trajectories for turn in trajectory.turns if turn.guided]
        if guided:                                       # ActFirst-OPD's reference guidance (App. B.5)
            stats["guided_turn_fraction"] = len(guided) / turns
            stats["guided_invalid_proposal_fraction"] = float(np.mean(["invalid_proposal" in t.info for t in guided]))
            stats["guided_check_failed_fraction"] = float(np.mean([t.check is not None and not t.check.ok
                                                                   for t in guided]))
        return stats

    def _has_eval(self, version: int) -> bool:
        return any(r.get("step") == version for r in read_jsonl(self.out_dir / "eval.jsonl"))

    def _evaluate(self, version: int, wall_start: float, wall_s: float | None = None) -> float:
        """Evaluates the current student, the rollouts paused during the run (``wall_s`` given: the run's end, they
        are already); returns the seconds it took, which the training wall-clock does not count."""
        if wall_s is None:
            self.samples.pause()
        wall = time.perf_counter() - wall_start if wall_s is None else wall_s
        t0 = time.perf_counter()
        result = dict(self.evaluate_fn(self.engine, version))
        self._writer.write("eval", version, {"wall_s": wall, "eval_s": time.perf_counter() - t0, **result})
        if wall_s is None:
            self.samples.resume()
        return time.perf_counter() - t0


class _NoWriter:
    """The metrics writer of a multi-process run's other processes: process 0 writes the run's records."""

    def write(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
