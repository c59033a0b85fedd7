"""What every rollout strategy shares: configuration, one episode loop over an ``EnvPool`` slot, and collection
of a batch of tasks over the pool's slots.

Owns ``RolloutConfig`` (turn limit, prompt budget, App. B.3 thinking budget, sampling settings, base seed),
``Decision`` (what a strategy chose at a turn), ``Episode`` (the live state of one rollout: o_t, the stored
history h_t of (o_i, executed a_i) pairs of App. B.2), and ``RolloutStrategy``: its episode loop resets the
slot, asks the strategy for a decision per turn, executes the action, runs the strategy's post-step hook
(ActFirst-OPD's transition check), and assembles the ``Trajectory``; ``play`` runs a batch over the pool's slots
and reports each task's outcome (its trajectory or the reason it failed; ``collect`` raises ``EpisodesFailed``
instead); its helpers render prompts and submit full (budgeted) and action-only requests with per-(task, turn,
role) seeds. Strategies block on futures in one host thread per episode, so the engine batches across episodes
while environments step in the pool.
"""
from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import queue
import zlib
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from jaxopd_envs.base import Observation, Task
from jaxopd_envs.checks import is_alfworld_action_valid, is_scienceworld_action_valid
from jaxopd_envs.references import ReferenceTrajectory
from jaxopd.rollout.prompts import PromptInputs, PromptOverBudget, render_prompt
from jaxopd.rollout.tags import ACTION_STOP_STRING
from jaxopd.rollout.thinking import ThinkingBudget, submit_budgeted
from jaxopd.rollout.trajectory import EpisodeOutcome, EpisodesFailed, Response, Trajectory, Turn
from jaxopd.sampler.types import Request, SamplingParams

__all__ = ["GenerationEngine", "RolloutConfig", "Decision", "Episode", "PromptOverBudget", "RolloutStrategy",
           "EpisodeOutcome", "EpisodesFailed", "request_seed", "then", "is_action_valid"]


class GenerationEngine(Protocol):
    """The part of the engine surface (``jaxopd.sampler``'s engine protocol) a rollout needs."""

    def submit(self, request: Request) -> Future:
        ...


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Settings every strategy shares; defaults are ActFirst-OPD's training settings (Table 6, App. B.2-B.3).

    ``max_turns``: the interaction limit (30 on ALFWorld and ScienceWorld). ``max_prompt_tokens``: the prompt
    budget of App. B.2 (10,240). ``thinking_budget``: App. B.3's two-request budget for full responses
    (training: 384 first-stage / 512 total / 128 second stage). ``temperature``/``top_p``/``top_k``: the
    student's rollout sampling (1.0 / 1.0 / off); behaviour log-probs are taken at this temperature.
    ``seed``: the base of every request's sampling seed, so strategies see the same seeds for the same
    task, turn and role (App. C.5: "sampling seeds matched across strategies for each task and turn").
    ``fixed_output_lengths``: the rollout-efficiency protocol of App. C.5 (Table 8), not training: every request
    generates exactly its token limit (``min_new_tokens == max_new_tokens``, no stop strings, end-of-sequence
    ignored), and a full response is one request of ``thinking_budget.total_tokens`` tokens, without the
    App. B.3 early-stop insertion (``experiments.actfirst_alfworld.protocol`` replays fixed contexts this way).
    """

    max_turns: int = 30
    max_prompt_tokens: int = 10_240
    thinking_budget: ThinkingBudget = ThinkingBudget()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 42
    fixed_output_lengths: bool = False

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        SamplingParams(max_new_tokens=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k).validate()


def request_seed(base_seed: int, task_id: str, turn: int, role: str, index: int = 0) -> int:
    """The sampling seed of one request: a function of the task, the turn, the role and an index only."""
    entropy = [int(base_seed) & 0xFFFFFFFF, zlib.crc32(task_id.encode()), int(turn), zlib.crc32(role.encode()),
               int(index)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])


def then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(future.result())`` (exceptions, including ``fn``'s, are forwarded)."""
    out: Future = Future()

    def done(source: Future) -> None:
        try:
            out.set_result(fn(source.result()))
        except BaseException as error:  # noqa: BLE001 - delivered through the future
            out.set_exception(error)

    future.add_done_callback(done)
    return out


def is_action_valid(benchmark: str, action: str | None, observation: Observation) -> bool:
    """App. B.5 validity of ``action`` in the state ``observation``: its normalised text is admissible
    (ALFWorld: help excluded; ScienceWorld: the full admissible-action list)."""
    if benchmark == "alfworld":
        return is_alfworld_action_valid(action, observation.admissible_actions)
    if benchmark == "scienceworld":
        return is_scienceworld_action_valid(action, observation.admissible_actions)
    raise ValueError(f"no action validity rule for benchmark {benchmark!r}")


@dataclasses.dataclass
class Decision:
    """A strategy's choice at one turn. ``responses`` are the turn's training responses (or futures of them,
    resolved when the episode ends); ``action_responses`` the responses only used to choose ``action``."""

    action: str
    source: str
    responses: Sequence[Response | Future] = ()
    action_responses: Sequence[Response] = ()
    guided: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Episode:
    """The live state of one rollout. ``history`` is the stored h_t (App. B.2): (o_i, executed a_i) pairs,
    never truncated here (prompt rendering drops pairs from its own copy). ``state`` holds the strategy's
    own per-episode state (e.g. whether reference guidance still holds). ``policy_version``: the student
    version when the episode started."""

    slot: int
    task: Task
    reference: ReferenceTrajectory | None
    initial_observation: Observation
    observation: Observation
    policy_version: int
    history: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    steps: list[tuple[Decision, Observation, Observation, Any]] = dataclasses.field(default_factory=list)
    end_reason: str | None = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def benchmark(self) -> str:
        return self.task.benchmark

    @property
    def turn(self) -> int:
        """The current turn t (1-based): one more than the executed turns."""
        return len(self.steps) + 1


class RolloutStrategy(abc.ABC):
    """One rollout strategy over an engine (``submit(Request) -> Future[Result]``) and an ``EnvPool``.

    ``run_episode(slot, task, reference)`` plays one task on one pool slot and returns its ``Trajectory`` (or
    raises); ``play(tasks, references, seeds=)`` plays a batch concurrently, one host thread per pool slot, and
    returns one ``EpisodeOutcome`` per task (its trajectory, or why it failed); ``collect`` is ``play`` for
    callers that need every trajectory (``EpisodesFailed`` after the batch when one failed).
    ``policy_version`` is the student version the rollout engine currently serves; the loop sets it after
    each weight sync and every response records the version read when its request was submitted.
    """

    name: ClassVar[str] = ""
    needs_reference: ClassVar[bool] = False
    FULL_KIND: ClassVar[str] = "full"        # request tags (open tags a scheduling policy may rank)
    FAST_KIND: ClassVar[str] = "fast"
    TEACHER_KIND: ClassVar[str] = "teacher"
    CANDIDATE_KIND: ClassVar[str] = "candidate"

    def __init__(self, engine: GenerationEngine, pool: Any, tokenizer: Any, config: RolloutConfig | None = None, *,
                 policy_version: int = 0):
        if not callable(getattr(engine, "submit", None)):
            raise ValueError(f"engine must have submit(Request) -> Future, got {type(engine).__name__}")
        self.engine = engine
        self.pool = pool
        self.tokenizer = tokenizer
        self.config = config if config is not None else self.default_config()
        self.policy_version = policy_version

    @classmethod
    def default_config(cls) -> RolloutConfig:
        return RolloutConfig()

    # ------------------------------------------------------------------ the strategy's part
    @abc.abstractmethod
    def decide(self, episode: Episode) -> Decision | None:
        """The action of turn ``episode.turn`` (and the responses behind it), or None to end the rollout after
        setting ``episode.end_reason``."""

    def start_episode(self, episode: Episode) -> None:
        """Set up ``episode.state`` after the reset (e.g. reference guidance)."""

    def after_step(self, episode: Episode, decision: Decision, next_observation: Observation) -> Any:
        """Runs after the environment executed ``decision.action`` (before ``episode`` advances); returns the
        turn's transition check, if any. May set ``episode.end_reason`` to end the rollout after this turn."""
        return None

    # ------------------------------------------------------------------ episodes
    def run_episode(self, slot: int, task: Task, reference: ReferenceTrajectory | None = None, *,
                    seed: int | None = None) -> Trajectory:
        """Play ``task`` on pool slot ``slot`` until the environment ends it, the turn limit, or the strategy.

        ``seed``: this episode's base sampling seed (default ``config.seed``); a training loop that revisits a
        task passes a new one per visit, so the revisit does not replay the same random numbers."""
        if self.needs_reference and reference is None:
            raise ValueError(f"{self.name} needs a reference trajectory for {task.task_id}")
        if reference is not None and reference.task_id != task.task_id:
            raise ValueError(f"reference {reference.task_id!r} does not belong to task {task.task_id!r}")
        initial = self.pool.submit_reset(slot, task).result()
        episode = Episode(slot=slot, task=task, reference=reference, initial_observation=initial,
                          observation=initial, policy_version=self.policy_version)
        if seed is not None:
            episode.state["seed"] = int(seed)
        self.start_episode(episode)
        while episode.end_reason is None:
            if episode.observation.done:
                episode.end_reason = "done"
                break
            if episode.turn > self.config.max_turns:
                episode.end_reason = "max_turns"
                break
            try:
                decision = self.decide(episode)
            except PromptOverBudget:
                episode.end_reason = "prompt_over_budget"
                break
            if decision is None:
                if episode.end_reason is None:
                    raise RuntimeError(f"{self.name}.decide ended the rollout without an end_reason")
                break
            next_observation = self.pool.submit_step(slot, decision.action).result()
            check = self.after_step(episode, decision, next_observation)
            episode.steps.append((decision, episode.observation, next_observation, check))
            episode.history.append((episode.observation.text, decision.action))
            episode.observation = next_observation
        return self._trajectory(episode)

    def _trajectory(self, episode: Episode) -> Trajectory:
        turns = []
        for index, (decision, observation, next_observation, check) in enumerate(episode.steps, start=1):
            responses = tuple(r.result() if isinstance(r, Future) else r for r in decision.responses)
            turns.append(Turn(index=index, observation=observation, action=decision.action,
                              next_observation=next_observation, action_source=decision.source,
                              responses=responses, action_responses=tuple(decision.action_responses),
                              guided=decision.guided, check=check, info=dict(decision.info)))
        return Trajectory(task=episode.task, strategy=self.name, initial_observation=episode.initial_observation,
                          turns=tuple(turns), end_reason=episode.end_reason,
                          info={"policy_version": episode.policy_version, "slot": episode.slot,
                                **{k: v for k, v in episode.state.items() if isinstance(v, (bool, int, float, str))}})

    def play(self, tasks: Sequence[Task], references: Mapping[str, ReferenceTrajectory] | None = None, *,
             seeds: Sequence[int | None] | None = None, slots: int | None = None) -> list[EpisodeOutcome]:
        """Play ``tasks`` concurrently, at most one episode per pool slot at a time; one ``EpisodeOutcome`` per
        task, in task order, whatever happened to the others.

        Owns the batch: hands pool slots to episodes, runs each episode in its own host thread, and turns an
        episode that raised (an ``EnvError`` the pool could not recover, an engine error, a bad reference)
        into a failed outcome whose ``error`` is ``"ExcType: message"``; it returns only when every episode has
        finished, so no trajectory is dropped because another failed. Recovering a crashed environment is the
        pool's (``jaxopd_envs.pool.EnvPool`` rebuilds and replays); this method only reports what could not be saved.

        ``references`` maps task ids to reference trajectories (required by reference-guided strategies).
        ``seeds``: one episode seed per task (None: ``config.seed``), passed to ``run_episode(..., seed=)``; a
        task listed twice with two seeds is played twice. ``slots``: how many pool slots to use (default all).
        Invalid arguments raise ``ValueError`` before any episode starts; a ``BaseException`` that is not an
        ``Exception`` (KeyboardInterrupt) is not turned into an outcome and propagates.
        """
        tasks = list(tasks)
        references = dict(references or {})
        if seeds is None:
            seeds = [None] * len(tasks)
        else:
            seeds = list(seeds)
            if len(seeds) != len(tasks):
                raise ValueError(f"seeds must give one seed per task: {len(seeds)} seeds for {len(tasks)} tasks")
        for task in tasks:
            if not isinstance(task, Task):
                raise ValueError(f"tasks must be jaxopd_envs.base.Task records, got {type(task).__name__}")
        num_slots = self.pool.num_slots if slots is None else slots
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 1 <= num_slots <= self.pool.num_slots:
            raise ValueError(f"slots must be in [1, {self.pool.num_slots}] (the pool's slots), got {slots!r}")
        free_slots: queue.SimpleQueue = queue.SimpleQueue()
        for slot in range(num_slots):
            free_slots.put(slot)

        def play_one(index: int, task: Task, seed: int | None) -> EpisodeOutcome:
            slot = free_slots.get()
            try:
                trajectory = self.run_episode(slot, task, references.get(task.task_id), seed=seed)
            except Exception as error:  # noqa: BLE001 - one failed episode is reported, never lost with the others
                return EpisodeOutcome.failed(index, task, error)
            finally:
                free_slots.put(slot)
            return EpisodeOutcome(index=index, task=task, trajectory=trajectory)

        if not tasks:
            return []
        workers = max(1, min(num_slots, len(tasks)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                   thread_name_prefix=f"rollout-{self.name}") as executor:
            futures = [executor.submit(play_one, index, task, seed)
                       for index, (task, seed) in enumerate(zip(tasks, seeds))]
            concurrent.futures.wait(futures)
            return [future.result() for future in futures]

    def collect(self, tasks: Sequence[Task],
                references: Mapping[str, ReferenceTrajectory] | None = None, *,
                seeds: Sequence[int | None] | None = None) -> list[Trajectory]:
        """Every task's trajectory, in task order: :meth:`play`, then, if any episode failed, ``EpisodesFailed``
        (raised only after every episode finished; its ``outcomes`` hold the trajectories that completed and
        its message names each failed task with its reason). For callers that cannot use a partial batch;
        callers that can should use :meth:`play`.
        """
        outcomes = self.play(tasks, references, seeds=seeds)
        failed = [outcome for outcome in outcomes if not outcome.ok]
        if failed:
            raise EpisodesFailed(outcomes) from failed[0].exception
        return [outcome.trajectory for outcome in outcomes]

    # ------------------------------------------------------------------ helpers for strategies
    def seed(self, episode: Episode, role: str, index: int = 0) -> int:
        return request_seed(episode.state.get("seed", self.config.seed), episode.task.task_id, episode.turn, role,
                            index)

    def rng(self, episode: Episode, role: str) -> np.random.Generator:
        """A generator for the host-side draws of a turn (STI's Bernoulli, ActionOPD's tie-break)."""
        return np.random.default_rng(self.seed(episode, role))

    def prompt_inputs(self, episode: Episode, reference_next_observation: str | None = None) -> PromptInputs:
        """The turn's ``PromptInputs`` from the current observation and the stored history."""
        observation = episode.observation
        return PromptInputs(benchmark=episode.benchmark, instruction=observation.instruction,
                            history=episode.history, observation=observation.text,
                            admissible_actions=observation.admissible_actions,
                            action_templates=observation.action_templates, objects=observation.objects,
                            reference_next_observation=reference_next_observation)

    def render(self, mode: str, inputs: PromptInputs, tokenizer: Any = None) -> list[int]:
        """Prompt ids of ``mode`` under the prompt budget (App. B.2); ``PromptOverBudget`` when nothing fits."""
        return render_prompt(tokenizer or self.tokenizer, mode, inputs, self.config.max_prompt_tokens).token_ids

    def sampling_params(self, max_new_tokens: int, seed: int, *, stop_strings: tuple[str, ...] = (),
                        temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None) -> SamplingParams:
        config = self.config
        fixed = config.fixed_output_lengths           # App. C.5: exactly max_new_tokens, nothing stops a request
        return SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if fixed else 0,
                              temperature=config.temperature if temperature is None else temperature,
                              top_p=config.top_p if top_p is None else top_p,
                              top_k=config.top_k if top_k is None else top_k,
                              stop_strings=() if fixed else stop_strings, seed=seed)

    def submit_full(self, episode: Episode, prompt_ids: Sequence[int], *, engine: GenerationEngine | None = None,
                    tokenizer: Any = None, role: str = "full", index: int = 0, kind: str | None = None,
                    params: SamplingParams | None = None, budget: ThinkingBudget | None = None,
                    teacher_generated: bool = False, **fields) -> Future:
        """Submit a full think-then-act response under the thinking budget (App. B.3); ``Future[Response]``.

        With ``config.fixed_output_lengths`` it is one request of exactly ``budget.total_tokens`` tokens (App. C.5).
        """
        budget = budget or self.config.thinking_budget
        if self.config.fixed_output_lengths:
            params = dataclasses.replace(params or self.sampling_params(budget.total_tokens,
                                                                        self.seed(episode, role, index)),
                                         max_new_tokens=budget.total_tokens, min_new_tokens=budget.total_tokens,
                                         stop_strings=())
            request = Request(list(prompt_ids), params, kind=kind or self.FULL_KIND)
            version = self.policy_version
            decoder = tokenizer or self.tokenizer
            return then((engine or self.engine).submit(request),
                        lambda result: Response.from_result(result, mode="full", policy_version=version,
                                                            tokenizer=decoder, teacher_generated=teacher_generated,
                                                            **fields))
        params = params or self.sampling_params(1, self.seed(episode, role, index))
        budgeted = submit_budgeted(engine or self.engine, tokenizer or self.tokenizer, list(prompt_ids), params,
                                   budget, kind=kind or self.FULL_KIND)
        version = self.policy_version
        return then(budgeted, lambda b: Response.from_budgeted(b, prompt_ids=prompt_ids, mode="full",
                                                               policy_version=version,
                                                               teacher_generated=teacher_generated, **fields))

    def submit_action(self, episode: Episode, prompt_ids: Sequence[int], mode: str, *, max_new_tokens: int,
                      role: str, index: int = 0, kind: str | None = None) -> Future:
        """Submit an action-only request: stops at ``</action>`` or ``max_new_tokens``; ``Future[Response]``."""
        params = self.sampling_params(max_new_tokens, self.seed(episode, role, index),
                                      stop_strings=(ACTION_STOP_STRING,))
        request = Request(list(prompt_ids), params, kind=kind or self.FAST_KIND)
        version = self.policy_version
        return then(self.engine.submit(request),
                    lambda result: Response.from_result(result, mode=mode, policy_version=version,
                                                        tokenizer=self.tokenizer))
