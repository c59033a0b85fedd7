"""The training loop shared by every distillation method: asynchronous rollouts, teacher scoring, the sharded
update, weight sync, checkpoints, evaluation and metrics.

Owns ``Trainer``. Rollout runners (``RunConfig.rollout_slots`` host threads, the papers' runners) play training
tasks with the method's strategy on the student's paged-KV engine and stream finished trajectories into a FIFO
``SampleBuffer`` whose version-lag bound (<= 1) drops stale samples. The trainer waits for ``batch_size``
fresh samples, fills the teacher's log-probabilities on the teacher mesh, runs the jitted train step on the
trainer mesh, and syncs the new weights to the rollout engine after every update (responses record the
version they were sampled with). ActionOPD instead collects ``collection_tasks`` task starts with one
behaviour snapshot and trains one epoch of minibatches over them (its App. A.4). ActFirst-OPD's reference
trajectories are built as the run first draws their tasks (``jaxopd_envs.references.LazyReferences``, cached across
runs), not all before the first update; a task whose reference cannot be built fails its episode only.

Checkpoints (orbax: train state + buffer + cursor) are written every ``checkpoint_every`` updates at the moment
the next batch is already buffered, so a resumed run takes exactly the batch an uninterrupted one would have
taken: the next loss is the same. Rollouts that were in flight when a run stopped are replayed from the task
cursor on resume, and the metrics written after the checkpoint are rewound. With ``rollout_mode="sync"`` the
runners play waves of ``rollout_slots`` episodes in task order between updates instead of streaming, so the whole
run is reproducible: a run killed and resumed any number of times gives the same losses as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from jaxopd_envs.base import Task
from jaxopd_envs.references import LazyReferences, ReferenceBuildError
from jaxopd.methods import registry
from jaxopd.methods.base import Method, RolloutResources
from jaxopd.methods.benchmarks import TRAIN_SPLIT, BenchmarkSource, lazy_references_for, subset
from jaxopd.methods.config import RunConfig
from jaxopd.methods.metrics_log import MetricsWriter
from jaxopd.methods.run_folder import CONFIG_FILE, Interrupted, check_and_save_config, run_folder
from jaxopd.models.decoder import CausalLM
from jaxopd.models.sharding import copy_to, named_shardings
from jaxopd.rollout.scoring import EngineTeacherScorer
from jaxopd.rollout.trajectory import Trajectory, rollout_quality
from jaxopd.sampler.engine import Engine, EngineConfig
from jaxopd.train.buffer import Sample, SampleBuffer, collate_samples
from jaxopd.train.checkpoint import TrainCheckpointer
from jaxopd.train.mesh import RolePlan, build_meshes
from jaxopd.train.step import (OptimizerConfig, abstract_train_state, batch_shardings, check_supervised_fit,
                               init_train_state,
                               make_optimizer, make_teacher_scorer, make_train_step, place_batch, score_batch,
                               train_state_shardings)
from jaxopd.train.sync import WeightSync

__all__ = ["Trainer", "engine_config_for", "batch_length", "CONFIG_FILE", "check_and_save_config"]

_MAX_EMPTY_COLLECTIONS = 3      # collections / sync waves in a row without one trainable sample before giving up
_MAX_FAILED_IN_A_ROW = 8        # async: this many x rollout_slots failed episodes in a row stop the run
_POLL_S = 0.25                  # how often a trainer waiting for samples looks for SIGINT / SIGTERM


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
                        max_prefill_rows=4, prefix_sharing=config.prefix_sharing, scoring=scoring)


def batch_length(longest: int, limit: int) -> int:
    """Training batches are padded to a multiple of 128 tokens (at most ``limit`` rounded up to 16): few shapes,
    little padding."""
    return max(longest, min(-(-longest // 128) * 128, -(-limit // 16) * 16))


@dataclasses.dataclass
class _Finished:
    index: int
    trajectory: Trajectory | None
    error: str | None = None


class _Runners:
    """``slots`` host threads that play training tasks ``task_at(i)`` for i = cursor, cursor + 1, ... and put
    every finished episode on ``results``. ``pause()`` stops starting episodes and waits for the running ones.

    Backpressure: with a ``backlog`` (samples), a runner starts an episode only while the samples ahead of the
    trainer (``queued``, the fresh samples the trainer reports buffered, plus ``per_episode`` for each episode
    running or delivered and not yet taken in with ``delivered``) stay below it; one episode may always run.
    Without it the runners play without pause and most of what they play goes stale before the trainer can take
    it (2026-12-03, 10 CPU updates of vanilla OPD: 20 episodes played and 223 samples dropped without a bound, 11
    and 33 with the default one, in the same wall-clock)."""

    def __init__(self, strategy: Any, slots: int, task_at: Callable[[int], tuple[Task, Any, int]], start: int,
                 *, backlog: int | None = None, per_episode: float = 1.0):
        self.strategy = strategy
        self.task_at = task_at
        self.results: queue.Queue[_Finished] = queue.Queue()
        self._next = start
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._stop = threading.Event()
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._backlog = backlog
        self._queued = 0
        self._undelivered = 0       # episodes put on results and not yet taken in by the trainer
        self._per_episode = float(per_episode)
        self._episodes_seen = 0
        self._samples_seen = 0
        self.max_busy = 0           # the most episodes played at once (for tests and logs)
        self._threads = [threading.Thread(target=self._loop, args=(slot,), name=f"rollout-runner-{slot}",
                                          daemon=True) for slot in range(slots)]
        self._in_flight: set[int] = set()
        for thread in self._threads:
            thread.start()

    def resume(self) -> None:
        with self._idle:
            self._running.set()
            self._idle.notify_all()

    def pause(self) -> None:
        with self._idle:
            self._running.clear()
            self._idle.notify_all()
            self._idle.wait_for(lambda: self._busy == 0)

    def report(self, queued: int) -> None:
        """The trainer's count of fresh buffered samples (after it buffers or takes samples, or a version
        passes)."""
        with self._idle:
            self._queued = int(queued)
            self._idle.notify_all()

    def delivered(self, samples: int, queued: int) -> None:
        """The trainer took in one result of ``results`` that gave ``samples`` samples (0 for a failed
        episode) and now holds ``queued`` fresh ones."""
        with self._idle:
            self._undelivered -= 1
            if samples:
                self._episodes_seen += 1
                self._samples_seen += int(samples)
                self._per_episode = self._samples_seen / self._episodes_seen
            self._queued = int(queued)
            self._idle.notify_all()

    def _may_start(self) -> bool:
        if self._backlog is None or self._busy + self._undelivered == 0:    # never let the trainer starve
            return True
        return self._queued + (self._busy + self._undelivered) * self._per_episode < self._backlog

    def low_water(self) -> int:
        """The first task index whose episode has not been delivered: where a resumed run starts again."""
        with self._lock:
            return min(self._in_flight) if self._in_flight else self._next

    def close(self) -> None:
        with self._idle:
            self._stop.set()
            self._running.set()
            self._idle.notify_all()
        for thread in self._threads:
            thread.join(timeout=600)

    def _loop(self, slot: int) -> None:
        while True:
            self._running.wait()
            if self._stop.is_set():
                return
            with self._idle:
                self._idle.wait_for(lambda: self._stop.is_set() or not self._running.is_set() or self._may_start())
                if self._stop.is_set():
                    return
                if not self._running.is_set():
                    continue
                index = self._next
                self._next += 1
                self._busy += 1
                self.max_busy = max(self.max_busy, self._busy)
                self._in_flight.add(index)
            try:
                try:     # the task's reference may be built here, and fail: that episode fails, not the runner
                    task, reference, seed = self.task_at(index)
                    trajectory = self.strategy.run_episode(slot, task, reference, seed=seed)
                    finished = _Finished(index, trajectory)
                except Exception as error:  # noqa: BLE001 - one failed episode never stops the run
                    finished = _Finished(index, None, f"{type(error).__name__}: {error}")
                with self._idle:
                    self._undelivered += 1
                self.results.put(finished)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._in_flight.discard(index)
                    self._idle.notify_all()


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
        if teacher is None and (self.method.uses_teacher_engine or self.method.loss_config().needs_teacher_logp):
            raise ValueError(f"{config.method} needs a teacher model")
        if teacher is not None and teacher.config.vocab_size != student.config.vocab_size:
            raise ValueError(f"the teacher's vocabulary ({teacher.config.vocab_size}) differs from the student's "
                             f"({student.config.vocab_size}); OPD compares their log-probabilities token by token")
        if teacher is not None and teacher.config.token_map != student.config.token_map:
            raise ValueError("the teacher's and the student's token maps (sub-vocabularies of Qwen3's ids) differ; "
                             "OPD compares their log-probabilities token by token")
        self.student, self.teacher, self.tokenizer, self.source = student, teacher, tokenizer, source
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.evaluate_fn = evaluate
        self.log = log
        self._tasks_override = list(tasks) if tasks is not None else None
        self._references_override = references
        self._tensorboard = tensorboard
        self._on_phase = on_phase
        self._last_failure: str | None = None
        self._collection_sizes: dict[int, int] = {}     # ActionOPD: trainable samples of each collection step

    # ------------------------------------------------------------------ set-up
    def _check_config(self) -> None:
        check_and_save_config(self.out_dir, self.config)

    def _training_tasks(self) -> list[Task]:
        if self._tasks_override is not None:
            return self._tasks_override
        return subset(self.source.tasks(TRAIN_SPLIT[self.config.benchmark]), self.config.train_tasks,
                      seed=self.config.seed)

    def _task_at(self, index: int) -> tuple[Task, Any, int]:
        """Training task ``index`` of the run's endless stream: epoch by epoch, each a seeded permutation."""
        epoch, position = divmod(index, len(self.tasks))
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.tasks))
        task = self.tasks[int(order[position])]
        seed = int(np.random.SeedSequence([self.config.seed, index]).generate_state(1, np.uint32)[0])
        return task, (self.references or {}).get(task.task_id), seed

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Trains to ``config.updates`` and returns the summary. The folder is locked for the run (a second process
        is refused); SIGINT / SIGTERM write a checkpoint and raise ``run_folder.Interrupted``."""
        with run_folder(self.out_dir) as interruption:
            self._interruption = interruption
            return self._run()

    def _run(self) -> dict[str, Any]:
        config, method = self.config, self.method
        self._check_config()
        self.log(f"run config ({config.method} on {config.benchmark}, preset {config.preset}):\n{config.describe()}")
        loss_config = method.loss_config()
        meshes = build_meshes(RolePlan.for_device_count(len(jax.devices())))
        graphdef, params = nnx.split(self.student, nnx.Param)
        optimizer = make_optimizer(OptimizerConfig(learning_rate=config.learning_rate,
                                                   weight_decay=config.weight_decay,
                                                   max_grad_norm=config.max_grad_norm))
        state_shardings = train_state_shardings(params, optimizer, meshes.trainer)
        rows = batch_shardings(meshes.trainer)
        train_step = make_train_step(graphdef, optimizer, loss_config, state_shardings, rows)
        sync = WeightSync.for_mesh(params, meshes.rollout)

        checkpointer = TrainCheckpointer(self.out_dir / "checkpoints", max_to_keep=config.keep_checkpoints)
        meta: dict[str, Any] = {"cursor": 0, "collections": 0, "wall_s": 0.0, "episodes": 0, "failed_episodes": 0}
        restored = checkpointer.restore_latest(abstract_train_state(params, optimizer, state_shardings),
                                               warn=lambda message: self.log(f"warning: {message}"))
        if restored is not None:
            state, buffer = restored.state, restored.buffer or SampleBuffer(config.max_version_lag)
            meta.update({k: v for k, v in restored.metadata.items() if k in meta})
            self.log(f"resumed from the checkpoint of update {restored.step} ({len(buffer)} buffered samples, "
                     f"task cursor {meta['cursor']})")
        else:
            state, buffer = init_train_state(params, optimizer, state_shardings), SampleBuffer(config.max_version_lag)
        version = int(jax.device_get(state.step))
        self.state = state          # the current train state, for evaluation hooks
        self._too_long = 0          # samples longer than max_train_tokens, dropped (logged per update)

        scorer = teacher_params = None
        if loss_config.needs_teacher_logp:
            teacher_graphdef, teacher_state = nnx.split(self.teacher, nnx.Param)
            teacher_shardings = named_shardings(teacher_state, meshes.teacher)
            teacher_params = copy_to(teacher_state, teacher_shardings)
            scorer = make_teacher_scorer(teacher_graphdef, teacher_shardings, meshes.teacher,
                                         temperature=loss_config.temperature,
                                         logits_chunk_size=loss_config.logits_chunk_size,
                                         max_supervised_tokens=loss_config.max_supervised_tokens,
                                         dense=loss_config.needs_teacher_dense, top_k=loss_config.exact_top_k)

        self.tasks = self._training_tasks()
        if not self.tasks:
            raise ValueError("no training tasks")
        self._orders: dict[int, np.ndarray] = {}
        self.references = self._references_override
        if method.needs_references and self.references is None:   # built as the run draws their tasks
            self.references = lazy_references_for(self.source, self.tasks)

        from jaxopd_envs.pool import EnvPool
        engine = Engine(self.student, engine_config_for(config, method), tokenizer=self.tokenizer,
                        policy_version=version)
        teacher_engine = None
        if method.uses_teacher_engine:
            teacher_engine = Engine(self.teacher, engine_config_for(config, method, scoring=True),
                                    tokenizer=self.tokenizer)
        pool = EnvPool(self.source.env_factory, config.rollout_slots)
        # every record after the restored update (or after update 0 of a run that never wrote a checkpoint) was
        # written by a run that stopped before saving it, and will be written again
        writer = MetricsWriter(self.out_dir, tensorboard=self._tensorboard, resume_step=version)
        runners = None
        try:
            engine.start()
            if teacher_engine is not None:
                teacher_engine.start()
            if version > 0:     # the engine serves the restored student
                engine.update_weights(sync(state.params, version).params, version=version)
            resources = RolloutResources(
                engine=engine, pool=pool, tokenizer=self.tokenizer, teacher_engine=teacher_engine,
                teacher_scorer=(EngineTeacherScorer(teacher_engine, temperature=loss_config.temperature)
                                if teacher_engine is not None else None),
                references=self.references)
            strategy = method.build_strategy(resources)
            strategy.policy_version = version
            self.engine, self.strategy = engine, strategy
            if self.evaluate_fn is not None and version == 0 and not (self.out_dir / "eval.jsonl").is_file():
                writer.write("eval", 0, {"wall_s": 0.0, **self.evaluate_fn(engine, 0)})

            progress = None
            if self.progress:
                from tqdm import tqdm
                if method.trains_in_collections:        # the paper's steps: collection steps
                    progress = tqdm(total=config.updates, initial=int(meta["collections"]),
                                    desc=f"{config.method} collection steps", unit="collection")
                else:
                    progress = tqdm(total=config.updates, initial=version, desc=f"{config.method} updates",
                                    unit="update")
            if not method.trains_in_collections and config.rollout_mode == "async":
                runners = _Runners(strategy, config.rollout_slots, self._task_at, int(meta["cursor"]),
                                   backlog=config.backlog_limit(), per_episode=config.max_turns)
                runners.report(buffer.available(version))
                runners.resume()
            pending: list[Trajectory] = []
            wall_start = time.perf_counter() - float(meta["wall_s"])
            last_saved = version
            while not self._finished(version, meta, buffer):
                timings: dict[str, float] = {}
                t0 = time.perf_counter()
                # 1. samples: a stream (vanilla / ActFirst / STI, async), waves in task order (sync), or one
                #    collection (ActionOPD)
                self._phase("rollout", version + 1)
                if runners is None:
                    wave = config.collection_tasks if method.trains_in_collections else config.rollout_slots
                    wanted = 1 if method.trains_in_collections else config.batch_size
                    empty = 0
                    while buffer.available(version) < wanted:
                        if empty == _MAX_EMPTY_COLLECTIONS:       # before the budget: a run of empty ones is an error
                            what = "collections" if method.trains_in_collections else "waves"
                            raise RuntimeError(
                                f"{config.method}: {empty} consecutive {what} of {wave} task starts gave no training "
                                "samples"
                                + (" (no state had a valid teacher action and a reward range among its candidates); "
                                   "the teacher or the student cannot act in this format"
                                   if method.trains_in_collections else f"; last failure: {self._last_failure}"))
                        if method.trains_in_collections and int(meta["collections"]) >= config.updates:
                            break       # the last collection step gave nothing left to train on
                        start = int(meta["cursor"])
                        picks = self._picks(range(start, start + wave))
                        trajectories = self._collect(strategy, picks)
                        meta["cursor"] = start + wave
                        collection = int(meta["collections"])
                        meta["collections"] = collection + 1
                        meta["episodes"] += len(trajectories)
                        meta["failed_episodes"] += wave - len(trajectories)
                        pending.extend(trajectories)
                        before = buffer.available(version)
                        buffer.add(self._fit(method.samples(trajectories, collection_id=collection)))
                        self._collection_sizes[collection] = buffer.available(version) - before
                        empty = empty + 1 if buffer.available(version) == before else 0
                        if progress is not None and method.trains_in_collections:
                            progress.update(1)
                        self._stop_if_interrupted(checkpointer, state, buffer, meta, None, version, wall_start)
                else:
                    failed_in_a_row = 0
                    while buffer.available(version) < config.batch_size:
                        try:
                            finished = runners.results.get(timeout=_POLL_S)
                        except queue.Empty:
                            self._stop_if_interrupted(checkpointer, state, buffer, meta, runners, version,
                                                      wall_start)
                            continue
                        if finished.trajectory is None:
                            runners.delivered(0, buffer.available(version))
                            meta["failed_episodes"] += 1
                            failed_in_a_row += 1
                            self.log(f"training episode {finished.index} failed: {finished.error}")
                            if failed_in_a_row >= _MAX_FAILED_IN_A_ROW * config.rollout_slots:
                                raise RuntimeError(f"{failed_in_a_row} training episodes in a row failed; "
                                                   f"last failure: {finished.error}")
                            continue
                        failed_in_a_row = 0
                        meta["episodes"] += 1
                        pending.append(finished.trajectory)
                        fitted = self._fit(method.samples([finished.trajectory]))
                        buffer.add(fitted)
                        runners.delivered(len(fitted), buffer.available(version))
                        meta["cursor"] = runners.low_water()
                timings["rollout_s"] = time.perf_counter() - t0
                if buffer.available(version) == 0:      # ActionOPD's collection steps are done
                    break
                # 2. checkpoint with the next batch buffered: a resume takes the same batch
                if version % config.checkpoint_every == 0 and version != last_saved:
                    t1 = time.perf_counter()
                    meta["wall_s"] = time.perf_counter() - wall_start
                    self._phase("checkpoint", version)
                    checkpointer.save(state, buffer, self._meta(meta, runners))
                    self._phase("saved", version)
                    last_saved = version
                    timings["checkpoint_s"] = time.perf_counter() - t1
                # 3. the update
                # ActionOPD's epoch ends with a smaller minibatch (padded with empty rows: same shape)
                samples = buffer.take(config.batch_size, version, allow_partial=method.trains_in_collections)
                host_batch = collate_samples(samples, batch_size=config.batch_size,
                                             length=batch_length(max(len(s) for s in samples), config.max_train_tokens))
                check_supervised_fit(host_batch.loss_mask, loss_config.max_supervised_tokens)
                t1 = time.perf_counter()
                if scorer is not None:
                    batch = score_batch(scorer, teacher_params, host_batch, rows)
                    jax.block_until_ready(batch.teacher_logp)
                else:
                    batch = place_batch(host_batch, rows)
                timings["scoring_s"] = time.perf_counter() - t1
                t1 = time.perf_counter()
                self._phase("step", version + 1)
                state, metrics = train_step(state, batch)
                self.state = state
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                timings["step_s"] = time.perf_counter() - t1
                version += 1
                # 4. weight sync to the rollout engine
                t1 = time.perf_counter()
                engine.update_weights(sync(state.params, version).params, version=version)
                strategy.policy_version = version
                timings["sync_s"] = time.perf_counter() - t1
                if runners is not None:     # the batch left the buffer, and the version moved on
                    runners.report(buffer.available(version))
                record = {**metrics, **timings, **self._batch_stats(samples, host_batch, version),
                          **self._rollout_stats(pending), "wall_s": time.perf_counter() - wall_start,
                          "buffer": len(buffer), "dropped_stale": buffer.stats.dropped_stale,
                          "dropped_too_long": self._too_long,
                          "episodes": meta["episodes"], "failed_episodes": meta["failed_episodes"]}
                if method.trains_in_collections:        # which collection step this minibatch belongs to
                    collection = max(sample.collection for sample in samples)
                    record.update(collection=collection, collections=int(meta["collections"]),
                                  collection_samples=self._collection_sizes.get(collection, -1))
                if isinstance(self.references, LazyReferences):     # references this process built / read
                    record.update(references_built=self.references.built, references_read=self.references.read)
                pending = []
                if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
                    raise FloatingPointError(f"update {version}: non-finite loss or gradient {metrics}")
                writer.write("train", version, record)
                if progress is not None:
                    if not method.trains_in_collections:
                        progress.update(1)
                    progress.set_postfix(loss=f"{metrics['loss']:.4f}", buffer=len(buffer))
                last = self._finished(version, meta, buffer)
                if self.evaluate_fn is not None and config.eval_every and version % config.eval_every == 0 \
                        and not last:
                    wall_start += self._evaluate(writer, runners, version, wall_start)
                if not last:
                    self._stop_if_interrupted(checkpointer, state, buffer, meta, runners, version, wall_start)
            meta["wall_s"] = time.perf_counter() - wall_start
            if runners is not None:
                runners.pause()
            if version != last_saved:
                self._phase("checkpoint", version)
                checkpointer.save(state, buffer, self._meta(meta, runners))
                self._phase("saved", version)
            if self.evaluate_fn is not None and not self._has_eval(version):
                self._evaluate(writer, None, version, wall_start, wall_s=meta["wall_s"])
            if progress is not None:
                progress.close()
            return {"updates": version, "collections": int(meta["collections"]), "wall_s": meta["wall_s"],
                    "episodes": meta["episodes"],
                    "failed_episodes": meta["failed_episodes"], "dropped_stale": buffer.stats.dropped_stale,
                    "out_dir": str(self.out_dir)}
        finally:
            # the engines first: episodes still in flight (an interrupted or failed run) then end at once
            engine.stop()
            if teacher_engine is not None:
                teacher_engine.stop()
            if runners is not None:
                runners.close()
            if isinstance(self.references, LazyReferences):
                self.references.close()
            writer.close()
            checkpointer.close()
            pool.close()

    # ------------------------------------------------------------------ helpers
    def _phase(self, phase: str, update: int) -> None:
        if self._on_phase is not None:
            self._on_phase(phase, update)

    def _fit(self, samples: list[Sample]) -> list[Sample]:
        """Samples longer than ``max_train_tokens`` cannot be trained on; they are dropped and counted."""
        kept = [s for s in samples if len(s) <= self.config.max_train_tokens]
        self._too_long += len(samples) - len(kept)
        return kept

    def _picks(self, indices: Iterable[int]) -> list[tuple[Task, Any, int]]:
        """The training tasks at ``indices`` with their references and seeds; a task whose reference cannot be
        built is logged and left out (its episode counts as failed)."""
        picks = []
        for index in indices:
            try:
                picks.append(self._task_at(index))
            except ReferenceBuildError as error:
                self._last_failure = f"{type(error).__name__}: {error}"
                self.log(f"training episode {index} failed: {self._last_failure}")
        return picks

    def _collect(self, strategy: Any, picks: Sequence[tuple[Task, Any, int]]) -> list[Trajectory]:
        """One ActionOPD collection or sync wave: every pick played once, ``rollout_slots`` at a time
        (``RolloutStrategy.play``); the trajectories come back in pick order, failed episodes are logged and
        counted by the caller."""
        if not picks:
            return []
        references = {task.task_id: reference for task, reference, _ in picks if reference is not None}
        outcomes = strategy.play([task for task, _, _ in picks], references, seeds=[seed for _, _, seed in picks])
        for outcome in outcomes:
            if not outcome.ok:
                self._last_failure = outcome.error
                self.log(f"training episode {outcome.task.task_id} failed: {outcome.error}")
        return [outcome.trajectory for outcome in outcomes if outcome.ok]

    def _finished(self, version: int, meta: Mapping[str, Any], buffer: SampleBuffer) -> bool:
        """Whether the run has trained ``config.updates`` steps as its paper counts them: optimizer updates for the
        streaming methods; for ActionOPD collection steps (its Table 8: 100 steps of 64 task starts), each followed
        by one epoch of minibatches over what it collected (App. A.4), so the run ends once the last collection
        step's epoch is trained."""
        if self.method.trains_in_collections:
            return int(meta["collections"]) >= self.config.updates and buffer.available(version) == 0
        return version >= self.config.updates

    def _meta(self, meta: dict[str, Any], runners: _Runners | None) -> dict[str, Any]:
        """A checkpoint's metadata: the counters, and the run's config (what a resume is checked against)."""
        if runners is not None:
            meta["cursor"] = runners.low_water()
        return {**{k: (float(v) if isinstance(v, float) else int(v)) for k, v in meta.items()},
                "config": self.config.to_dict()}

    def _stop_if_interrupted(self, checkpointer: TrainCheckpointer, state: Any, buffer: SampleBuffer,
                             meta: dict[str, Any], runners: _Runners | None, version: int, wall_start: float) -> None:
        """After SIGINT / SIGTERM: a checkpoint of the state, the buffer and the task cursor (episodes in flight
        are replayed on resume), then ``Interrupted``."""
        signum = self._interruption.signum
        if signum is None:
            return
        meta["wall_s"] = time.perf_counter() - wall_start
        self._phase("checkpoint", version)
        checkpointer.save(state, buffer, self._meta(meta, runners))
        self._phase("saved", version)
        raise Interrupted(signum, version)

    @staticmethod
    def _batch_stats(samples: Sequence[Sample], batch: Any, version: int) -> dict[str, float]:
        mask = np.asarray(batch.loss_mask)
        teacher = np.asarray(batch.teacher_generated) & mask
        lags = [version - 1 - s.policy_version for s in samples]
        return {"batch_samples": len(samples), "batch_tokens": int(mask.sum()),
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
        from jaxopd.methods.metrics_log import read_jsonl
        return any(r.get("step") == version for r in read_jsonl(self.out_dir / "eval.jsonl"))

    def _evaluate(self, writer: MetricsWriter, runners: _Runners | None, version: int, wall_start: float,
                  wall_s: float | None = None) -> float:
        """Evaluates the current student (rollouts paused); returns the seconds it took, which the training
        wall-clock does not count."""
        if runners is not None:
            runners.pause()
        wall = time.perf_counter() - wall_start if wall_s is None else wall_s
        t0 = time.perf_counter()
        result = dict(self.evaluate_fn(self.engine, version))
        writer.write("eval", version, {"wall_s": wall, "eval_s": time.perf_counter() - t0, **result})
        if runners is not None:
            runners.resume()
        return time.perf_counter() - t0
