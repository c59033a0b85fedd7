"""The one configuration of a training run, its presets and each method's paper defaults.

Owns ``RunConfig`` (every knob of a run: method, benchmark, models, schedule, optimisation, generation, engine,
evaluation), the presets ``cpu`` / ``gpu`` / ``paper`` that size a run to a machine, and the order in which
a config is built: the shared defaults (ActFirst-OPD Table 6), then the method's paper defaults (STI-OPD's
setup table, ActionOPD Tables 7-8), then the preset, then the user's overrides. A config is printed at the start
of a run and saved with it (``config.json``), with its departures from the method's paper (``departures_of``);
resuming checks that the saved one matches. ``RunConfig`` refuses every value that could not train (non-finite
numbers, token limits nothing fits, a loss the method's samples cannot feed); ``check_task_source`` and
``check_prompt_fits`` are the checks that need the environment or a tokenizer, run by the command lines before
anything is written.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from jaxopd.losses import ADVANTAGE_LOGP
from jaxopd.methods.benchmarks import BENCHMARKS, EVAL_SPLITS, GAME_SOURCES, GeneratedCounts
from jaxopd.models.decoder import PRESETS as MODEL_PRESETS
from jaxopd.rollout.tags import ACTION_FORMATS
from jaxopd.train.step import ADVANTAGE_KINDS, LR_SCHEDULES

METHODS = ("vanilla-opd", "actfirst", "actfirst-no-id", "actfirst-no-nap-fallback", "actfirst-prefix-replay-50",
           "actfirst-prefix-replay-100", "sti", "actionopd", "sft")
DEFAULT_LOSSES = {"sti": "sti-opd", "actionopd": "action-opd", "sft": "sft"}
"""Each method's own loss (every other method: ``opd``); ``RunConfig.resolved_loss``."""
_MAX_SEED = 2**32 - 2          # the teacher's random init takes seed + 1; both must be a uint32
PRESETS = ("cpu", "gpu", "paper")
ROLLOUT_MODES = ("async", "sync")
SFT_THINKING = ("none", "state", "plan", "plan-here", "task-plan-here", "task-list-plan-here",
                "task-list-act-here", "task-tool-act-here", "task-tool-refused-act-here")
"""What an SFT demonstration thinks before its action: ``none`` (an empty thinking block), ``state`` (ALFWorld:
a short reasoning over what the prompt shows, ``jaxopd.methods.sft_data.state_thinking``) or ``plan`` (ALFWorld: that
state and the step it calls for, the tool or the destination, ``jaxopd.methods.sft_data.plan_text``) or
``plan-here`` (ALFWorld: the plan and where the agent is, ``jaxopd.methods.sft_data.plan_here_text``) or
``task-plan-here`` (ALFWorld: the instruction restated word for word, then the plan-here words, and the tool's command
when the agent stands at the tool, ``jaxopd.methods.sft_data.task_plan_here_text``) or ``task-list-plan-here`` (the
same, with the object classes an arrival or an opening just listed copied after the instruction,
``jaxopd.methods.sft_data.task_list_plan_here_text``) or ``task-list-act-here`` (that, ending on the command to
give at the agent's location when there is one, ``jaxopd.methods.sft_data.task_list_act_here_text``) or
``task-tool-act-here`` (that, with the change task's verb and tool said right after the instruction in every turn,
``jaxopd.methods.sft_data.task_tool_act_here_text``) or ``task-tool-refused-act-here`` (that, with the last command
said after the instruction when the engine refused it, ``jaxopd.methods.sft_data.task_tool_refused_act_here_text``)."""
SFT_DEMONSTRATIONS = {"walkthrough": "solution", "searching-expert": "searching_expert"}
"""What SFT imitates, each with the ``jaxopd_envs.references`` kind of its references: the planner's walkthrough (it
knows where everything lies; ScienceWorld's gold path), or ALFWorld's searching expert (``jaxopd_envs.alfworld_expert``:
it looks for objects from what it has seen, as an agent on an unseen game must)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of a run. Defaults are ActFirst-OPD's Table 6 (shared by all methods unless a method's
    paper says otherwise, see ``METHOD_DEFAULTS``); ``build_config`` applies a preset and overrides.

    Schedule: ``updates`` optimizer updates of ``batch_size`` turn-level responses each; ``rollout_slots``
    episodes run concurrently (the paper's 16 runners); samples older than ``max_version_lag`` versions are
    dropped. ActionOPD collects ``collection_tasks`` task starts with one policy snapshot, then trains one
    epoch of ``batch_size`` minibatches over them. Checkpoints every ``checkpoint_every`` updates; evaluation
    every ``eval_every`` updates (0: only before and after training) on ``eval_tasks`` tasks of ``eval_split``.

    ``rollout_mode``: ``async`` (the papers' pipeline: runners stream episodes into the buffer while the trainer
    steps, so which sample lands in which batch depends on thread timing) or ``sync`` (reproducible: between two
    updates the runners play waves of ``rollout_slots`` episodes in task order with the current weights, and
    their samples enter the buffer in task order; a run, killed and resumed or not, gives the same losses).

    ``rollout_backlog`` (async): how many samples the runners may keep ahead of the trainer, counting the fresh
    samples buffered and, for each episode in flight or delivered but not yet buffered, the mean sample count of
    the episodes delivered so far (``max_turns`` before the first); a runner starts an episode only below it.
    None: ``batch_size * (max_version_lag + 1)``, as many as the version-lag bound lets the trainer use; 0: no
    bound (runners play without pause, and what the trainer cannot take in time is dropped as stale).

    Evaluation during training (``eval_*``) has its own turn limit, thinking budget and prompt limit: ActFirst-OPD
    App. C.4's 30 turns, 1,920 / 2,048 thinking tokens and 20,480 prompt tokens by default (every method is evaluated
    by that protocol; ActionOPD greedily, ``eval_greedy``, as its paper evaluates). ``advantage_logp``: which student
    log-prob OPD's and STI-OPD's advantage reads (``jaxopd.train.step.LossConfig.advantage_logp``).

    ``departures``: every way the run departs from its method's paper, in words (the preset's sizing, the user's
    overrides, and what this implementation does differently whatever the preset); ``describe()`` prints them and
    ``to_dict()`` (so ``config.json``) carries them. A check that refuses a value raises ``ValueError`` naming the
    field.
    """

    method: str = "actfirst"
    benchmark: str = "alfworld"
    preset: str = "paper"
    games: str = "auto"
    # generated ALFWorld games of the train split (the evaluation splits keep GeneratedCounts' sizes; valid_unseen, on
    # held-out floor plans with every game slot seeded on its own, stays the very same games; valid_seen can change)
    generated_train_games: int = GeneratedCounts.train
    # models: Hugging Face folders, or a random-initialised preset when a folder is not given (smoke runs only)
    student: str | None = None
    teacher: str | None = None
    student_model_preset: str = "qwen3-1.7b"
    teacher_model_preset: str = "qwen3-8b"
    # schedule
    updates: int = 250
    batch_size: int = 64
    rollout_slots: int = 16
    collection_tasks: int = 64
    train_tasks: int | None = None
    max_version_lag: int = 1
    rollout_mode: str = "async"
    rollout_backlog: int | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    seed: int = 42
    # optimisation (AdamW, constant lr, no warm-up)
    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    dual_clip: float = 3.0
    loss: str | None = None                  # None: the method's loss (opd / sti-opd / action-opd / sft);
                                             # opd-exact: OPD's reverse KL over the whole vocabulary
    advantage_logp: str = "current"          # opd / sti-opd advantage from the current or the sampled log-prob
    exact_top_k: int | None = None           # opd-exact over the teacher's top K ids and the rest (None: all ids)
    max_train_tokens: int = 16_384           # longest turn-level sample trained on (prompt + response)
    logits_chunk_size: int | None = 1024
    max_supervised_tokens: int | None = None   # project only the response positions (jaxopd.train.step)
    # generation
    max_turns: int = 30
    max_prompt_tokens: int = 10_240
    first_stage_tokens: int = 384
    total_tokens: int = 512
    second_stage_tokens: int = 128
    fast_action_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # ActionOPD (Table 7-8)
    num_candidates: int = 4
    num_teacher_samples: int = 3
    match_bonus_scale: float = 0.5
    teacher_temperature: float = 0.6
    teacher_top_p: float = 0.95
    # engine
    page_size: int = 16
    prefix_sharing: bool = True
    # evaluation
    eval_split: str | None = None            # None: the benchmark's unseen split (valid_unseen / eval)
    eval_tasks: int | None = None
    eval_every: int = 0
    eval_seeds: tuple[int, ...] = (42, 43, 44)
    eval_greedy: bool = False
    eval_temperature: float = 0.4            # ActFirst-OPD App. C: evaluation samples at 0.4
    eval_max_turns: int = 30                 # App. C.4 (Table 7): 30 turns,
    eval_max_prompt_tokens: int = 20_480     # 20,480 prompt tokens,
    eval_first_stage_tokens: int = 1_920     # and a thinking budget of 1,920 / 2,048 tokens
    eval_total_tokens: int = 2_048
    # SFT (the teacher): epochs over the demonstration turns, which demonstrations (SFT_DEMONSTRATIONS), and the
    # weight of the language-model term on the prompt tokens (0: the response only)
    sft_epochs: float = 3.0
    sft_demonstrations: str = "walkthrough"
    sft_context_weight: float = 0.0          # > 0: a language-model term on the prompt tokens too (sft.train_sft)
    sft_thinking: str = "none"               # SFT_THINKING: SFT's answers, and distillation's held-out answers
    sft_renamed_copies: int = 0              # copies of a demonstration, classes renamed (jaxopd_envs.alfworld_names)
    sft_take_copies: int = 0                 # more renamed copies of the turns whose action is ``take`` only
    sft_arrival_copies: int = 0              # ... and of the turns after a ``go to`` or ``open`` (sft_data.FOCUS_TURNS)
    sft_change_copies: int = 0               # ... and of the turns holding the goal object still to change
    sft_refused_copies: int = 0              # ... and of the turns after one refused command (sft_data.refused_turn)
    sft_missing_copies: int = 0              # ... and after a go to a missing receptacle (sft_data.missing_turn)
    sft_fast_copies: int = 0                 # ... and of every turn as ActFirst's fast requests (sft_data.FAST_MODES)
    lr_schedule: str = "constant"            # SFT only: "cosine" warms up over 5 % of the steps, then decays to 10 %
    sft_group_by_length: int = 0             # SFT only: batches of similar length, windows of this many (SFTDataset)
    sft_action_weight: float = 1.0           # SFT only: loss weight of the action tag's tokens (thinking: 1)
    sft_action_format: str = "tight"         # rollout.tags.ACTION_FORMATS: SFT's and held-out answers' action tags
    sub_vocabulary: bool = False             # SFT only: cut the model down to its corpus's ids (sft.to_sub_vocabulary)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.type == "float":
                value = getattr(self, field.name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"RunConfig.{field.name} must be a finite number, got {value!r}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; expected one of {METHODS}")
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.benchmark!r}; expected one of {BENCHMARKS}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {PRESETS}")
        if self.rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"unknown rollout mode {self.rollout_mode!r}; expected one of {ROLLOUT_MODES}")
        if self.sft_demonstrations not in SFT_DEMONSTRATIONS:
            raise ValueError(f"unknown SFT demonstrations {self.sft_demonstrations!r}; expected one of "
                             f"{tuple(SFT_DEMONSTRATIONS)}")
        if self.sft_thinking not in SFT_THINKING:
            raise ValueError(f"unknown SFT thinking {self.sft_thinking!r}; expected one of {SFT_THINKING}")
        if self.sft_thinking != "none" and self.benchmark != "alfworld":
            raise ValueError(f"{self.sft_thinking} thinking reads ALFWorld prompts; ScienceWorld SFT thinks nothing "
                             "(sft_thinking 'none')")
        if self.sft_action_format not in ACTION_FORMATS:
            raise ValueError(f"unknown SFT action format {self.sft_action_format!r}; expected one of "
                             f"{ACTION_FORMATS}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.lr_schedule!r}; expected one of {LR_SCHEDULES}")
        if self.lr_schedule != "constant" and self.method != "sft":
            raise ValueError(f"a {self.lr_schedule} learning-rate schedule is for SFT's fixed number of steps; the "
                             "distillation methods keep the papers' constant rate")
        if self.sft_action_weight != 1.0 and self.method != "sft":
            raise ValueError("sft_action_weight weights SFT's demonstration tokens; a distillation method's token "
                             "weights are its loss's")
        if self.loss == "opd-exact" and self.method not in ("vanilla-opd", "actfirst"):
            raise ValueError(f"the opd-exact loss replaces the sampled reverse KL of vanilla OPD and ActFirst-OPD; "
                             f"{self.method} trains its own objective")
        if self.exact_top_k is not None and self.loss != "opd-exact":
            raise ValueError("exact_top_k sizes the opd-exact loss's teacher distribution; pass --loss opd-exact")
        if self.sub_vocabulary and self.method != "sft":
            raise ValueError("sub_vocabulary cuts a model down to its SFT corpus's ids; a distillation method takes "
                             "the vocabulary its --student and --teacher folders have")
        if self.sft_group_by_length and self.method != "sft":
            raise ValueError("sft_group_by_length orders SFT's batches; a distillation method trains on the batches "
                             "its rollouts give")
        for name in ("sft_renamed_copies", "sft_take_copies", "sft_arrival_copies", "sft_change_copies",
                     "sft_refused_copies", "sft_missing_copies", "sft_fast_copies"):
            if getattr(self, name) and self.benchmark != "alfworld":
                raise ValueError(f"renamed demonstration copies rename ALFWorld's classes; ScienceWorld SFT has none "
                                 f"({name} 0)")
        if self.sft_demonstrations == "searching-expert" and self.benchmark != "alfworld":
            raise ValueError("the searching expert plays ALFWorld only; ScienceWorld SFT uses walkthrough (gold "
                             "path) demonstrations")
        if self.games not in GAME_SOURCES:
            raise ValueError(f"unknown game source {self.games!r}; expected one of {GAME_SOURCES}")
        if self.generated_train_games != GeneratedCounts.train and (self.benchmark != "alfworld"
                                                                    or self.games == "official"):
            raise ValueError(f"generated_train_games={self.generated_train_games} sizes generated ALFWorld games; "
                             f"this run uses {self.benchmark} ({self.games} games)")
        positive = ("generated_train_games", "updates", "batch_size", "rollout_slots", "collection_tasks",
                    "checkpoint_every", "keep_checkpoints", "max_train_tokens", "max_turns", "max_prompt_tokens",
                    "first_stage_tokens", "total_tokens", "fast_action_tokens", "num_candidates", "num_teacher_samples",
                    "page_size", "eval_max_turns", "eval_max_prompt_tokens", "eval_first_stage_tokens",
                    "eval_total_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunConfig.{name} must be a positive integer, got {value!r}")
        if self.rollout_backlog is not None and (isinstance(self.rollout_backlog, bool)
                                                 or not isinstance(self.rollout_backlog, int)
                                                 or self.rollout_backlog < 0):
            raise ValueError(f"RunConfig.rollout_backlog must be a non-negative integer or None, "
                             f"got {self.rollout_backlog!r}")
        for name in ("train_tasks", "eval_tasks", "logits_chunk_size", "max_supervised_tokens", "exact_top_k"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"RunConfig.{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"RunConfig.seed must be an integer from 0 to {_MAX_SEED}, got {self.seed!r}")
        for name in ("max_version_lag", "eval_every", "second_stage_tokens", "top_k", "sft_renamed_copies",
                     "sft_take_copies", "sft_arrival_copies", "sft_change_copies", "sft_refused_copies",
                     "sft_missing_copies", "sft_fast_copies", "sft_group_by_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RunConfig.{name} must be a non-negative integer, got {value!r}")
        for name in ("learning_rate", "max_grad_norm", "clip_eps", "dual_clip", "sft_epochs", "sft_action_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RunConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("temperature", "eval_temperature", "teacher_temperature", "weight_decay", "match_bonus_scale",
                     "sft_context_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RunConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("top_p", "teacher_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"RunConfig.{name} must lie in (0, 1], got {getattr(self, name)!r}")
        if self.first_stage_tokens > self.total_tokens:
            raise ValueError(f"RunConfig.first_stage_tokens ({self.first_stage_tokens}) exceeds total_tokens "
                             f"({self.total_tokens})")
        if self.eval_split is not None and self.eval_split not in EVAL_SPLITS[self.benchmark] + ("train",):
            raise ValueError(f"unknown {self.benchmark} evaluation split {self.eval_split!r}; expected one of "
                             f"{EVAL_SPLITS[self.benchmark]}")
        if not self.eval_seeds or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_SEED
                                          for s in self.eval_seeds):
            raise ValueError(f"RunConfig.eval_seeds must be a non-empty tuple of integers from 0 to {_MAX_SEED}, "
                             f"got {self.eval_seeds!r}")
        object.__setattr__(self, "eval_seeds", tuple(self.eval_seeds))
        if self.dual_clip <= 1:
            raise ValueError(f"RunConfig.dual_clip must be > 1, got {self.dual_clip}")
        if self.eval_first_stage_tokens > self.eval_total_tokens:
            raise ValueError(f"RunConfig.eval_first_stage_tokens ({self.eval_first_stage_tokens}) exceeds "
                             f"eval_total_tokens ({self.eval_total_tokens})")
        self._check_models()
        self._check_loss()
        self._check_games()
        self._check_token_limits()

    def _check_models(self) -> None:
        """A random-initialised model (no folder) needs an architecture preset of ``jaxopd.models.decoder``."""
        roles = [("student", self.student, self.student_model_preset)]
        if self.method != "sft":
            roles.append(("teacher", self.teacher, self.teacher_model_preset))
        for role, folder, preset in roles:
            if folder is None and str(preset).lower().replace("_", "-") not in MODEL_PRESETS:
                raise ValueError(f"RunConfig.{role}_model_preset {preset!r} is not a model preset (the {role} is "
                                 f"random-initialised without a {role} folder); choose one of {sorted(MODEL_PRESETS)}")
        if self.exact_top_k is not None and self.student is None:
            vocab = MODEL_PRESETS[self.student_model_preset.lower().replace("_", "-")].vocab_size
            check_exact_top_k(self.exact_top_k, vocab, f"the {self.student_model_preset} student's")

    def _check_loss(self) -> None:
        """A loss flag that would train nothing, or something other than the method says, is refused."""
        own = DEFAULT_LOSSES.get(self.method, "opd")
        if self.method == "sft" and self.loss not in (None, "sft"):
            raise ValueError(f"RunConfig.loss {self.loss!r}: the sft method trains the likelihood of demonstrations "
                             "(loss sft); the distillation losses need a teacher and rollouts")
        if self.method != "sft" and self.loss == "sft":
            raise ValueError(f"RunConfig.loss 'sft' trains on demonstrations; {self.method} distils from its "
                             f"rollouts (its loss: {own}); for SFT use --method sft")
        if self.loss == "action-opd" and self.method != "actionopd":
            raise ValueError(f"RunConfig.loss 'action-opd' reads ActionOPD's group advantages, which only the "
                             f"actionopd method's rollouts carry; on {self.method}'s samples they are 0, and so are "
                             f"its loss and gradient (its loss: {own})")
        if self.method == "actionopd" and self.loss not in (None, "action-opd"):
            raise ValueError(f"RunConfig.loss {self.loss!r}: ActionOPD's candidates are trained by its "
                             "agreement-reward objective (loss action-opd); its teacher is a black box")
        if self.advantage_logp not in ADVANTAGE_LOGP:
            raise ValueError(f"RunConfig.advantage_logp must be one of {ADVANTAGE_LOGP}, got {self.advantage_logp!r}")
        if self.advantage_logp != "current" and self.resolved_loss not in ADVANTAGE_KINDS:
            raise ValueError(f"RunConfig.advantage_logp {self.advantage_logp!r} chooses the log-prob of the sampled "
                             f"reverse-KL advantage of the {' / '.join(ADVANTAGE_KINDS)} losses; {self.method} trains "
                             f"{self.resolved_loss}")

    def _check_games(self) -> None:
        if self.benchmark == "scienceworld" and self.games != "auto":
            raise ValueError(f"RunConfig.games {self.games!r} chooses ALFWorld's game source (official or "
                             "generated); ScienceWorld has one, the scienceworld wheel's tasks")
        if (self.train_tasks is not None and self.benchmark == "alfworld" and self.games == "generated"
                and self.train_tasks > self.generated_train_games):
            raise ValueError(f"RunConfig.train_tasks {self.train_tasks} exceeds the {self.generated_train_games} "
                             "generated ALFWorld training games (generated_train_games)")

    def _check_token_limits(self) -> None:
        """Limits under which nothing could be trained on: every training sample is a prompt of at most
        ``max_prompt_tokens`` and a response of at most ``total_tokens`` (SFT: a demonstration's)."""
        if self.method == "sft":
            if self.max_train_tokens <= self.max_prompt_tokens:
                raise ValueError(f"RunConfig.max_train_tokens ({self.max_train_tokens}) leaves no room for a "
                                 f"demonstration's answer after a prompt of max_prompt_tokens "
                                 f"({self.max_prompt_tokens}); raise max_train_tokens or lower max_prompt_tokens")
            return
        longest = self.max_prompt_tokens + self.total_tokens
        if self.max_train_tokens < longest:
            raise ValueError(f"RunConfig.max_train_tokens ({self.max_train_tokens}) is below max_prompt_tokens + "
                             f"total_tokens ({self.max_prompt_tokens} + {self.total_tokens} = {longest}), the longest "
                             "turn-level sample; the samples of long prompts would be dropped")
        if self.max_supervised_tokens is not None and self.max_supervised_tokens < self.total_tokens:
            raise ValueError(f"RunConfig.max_supervised_tokens ({self.max_supervised_tokens}) is below total_tokens "
                             f"({self.total_tokens}): a whole response could not be trained on")

    @property
    def resolved_loss(self) -> str:
        """The loss the run trains: ``loss``, or the method's own."""
        return self.loss or DEFAULT_LOSSES.get(self.method, "opd")

    @property
    def resolved_eval_split(self) -> str:
        return self.eval_split or EVAL_SPLITS[self.benchmark][-1]

    def backlog_limit(self) -> int | None:
        """The samples the async runners may keep ahead of the trainer (``rollout_backlog`` resolved; None: no
        bound)."""
        if self.rollout_backlog is None:
            return self.batch_size * (self.max_version_lag + 1)
        return self.rollout_backlog or None

    @property
    def departures(self) -> tuple[str, ...]:
        """Every way this run departs from its method's paper (``departures_of``)."""
        return departures_of(self)

    def to_dict(self) -> dict[str, Any]:
        """The fields, and ``departures`` (derived from them; ``from_dict`` ignores it)."""
        data = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}
        data["departures"] = list(self.departures)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k != "departures"}      # derived, not a setting
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown RunConfig fields {unknown}")
        if "eval_seeds" in values:
            values["eval_seeds"] = tuple(values["eval_seeds"])
        return cls(**values)

    def describe(self) -> str:
        """The config as aligned ``name = value`` lines, then its departures from the paper, one a line (printed
        at the start of a run)."""
        data = self.to_dict()
        departures = data.pop("departures")
        width = max(len(k) for k in data)
        lines = [f"  {k.ljust(width)} = {data[k]!r}" for k in sorted(data)]
        lines.append(f"  departures from the {self.method} paper ({len(departures)}):" if departures
                     else "  departures from the paper: none")
        lines += [f"    - {d}" for d in departures]
        return "\n".join(lines)


# Each method's paper settings that differ from the shared (ActFirst-OPD Table 6) ones.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    # STI-OPD setup table: 200 steps, batch 32 prompts (ALFWorld, ScienceWorld), lr 1e-6, clip 1.0, T 1.0, top-p 1.0
    "sti": {"updates": 200, "batch_size": 32},
    # ActionOPD Tables 7-8: 100 collection steps of 64 task starts, N=4, K=3, lambda 0.5, minibatch 32, one epoch,
    # student T 0.6 / top-p 0.95 / top-k 20, teacher T 0.6 / top-p 0.95, 20 decisions (its ALFWorld-like limit);
    # Sec. 3.1: its students are evaluated with greedy decoding
    "actionopd": {"updates": 100, "batch_size": 32, "collection_tasks": 64, "temperature": 0.6, "top_p": 0.95,
                  "top_k": 20, "max_turns": 20, "eval_greedy": True},
    # supervised fine-tuning of the teacher on walkthroughs (no paper: our own CPU teacher)
    "sft": {"learning_rate": 1e-3, "weight_decay": 0.0, "batch_size": 16},
}

# Preset sizing. ``paper`` is the papers' setting; ``gpu`` one GPU; ``cpu`` a 2-core machine (tiny models,
# short responses, a few updates; its thinking budget, 48 of 64 tokens, holds the state thinking of the SFT
# teacher, whose longest response is 44 tokens); each also names the models a run uses without checkpoint folders.
# Evaluation: ``paper`` keeps App. C.4's limits (the RunConfig defaults); ``gpu`` its own prompt limit (20,480-token
# prompts for 32 engine slots would not fit one GPU's KV cache), ``cpu`` its training limits (a 2,048-token answer
# of the tiny model takes minutes on 2 cores); both are listed among the run's departures.
PRESET_OVERRIDES: dict[str, dict[str, Any]] = {
    "paper": {},
    "gpu": {"rollout_slots": 16, "max_prompt_tokens": 4096, "max_train_tokens": 5120, "updates": 100,
            "student_model_preset": "qwen3-0.6b", "teacher_model_preset": "qwen3-1.7b", "eval_tasks": 134,
            "eval_max_prompt_tokens": 4096},
    "cpu": {"rollout_slots": 4, "batch_size": 16, "collection_tasks": 4, "updates": 20, "checkpoint_every": 5,
            "max_prompt_tokens": 1024, "max_train_tokens": 1152, "first_stage_tokens": 48, "total_tokens": 64,
            "second_stage_tokens": 16, "fast_action_tokens": 24, "max_turns": 20, "logits_chunk_size": None,
            "max_supervised_tokens": 80,
            "student_model_preset": "tiny", "teacher_model_preset": "tiny", "eval_tasks": 12,
            "learning_rate": 1e-5, "eval_max_turns": 20, "eval_max_prompt_tokens": 1024,
            "eval_first_stage_tokens": 48, "eval_total_tokens": 64},
}
# A method's settings on one preset (after the preset's own). ActionOPD on ``paper``: Table 8's 4k-token student
# responses, one request (no App. B.3 early stop: that is ActFirst-OPD's decoding); on ``cpu``: minibatches of 8.
PRESET_METHOD_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {
    ("paper", "actionopd"): {"first_stage_tokens": 4096, "total_tokens": 4096},
    ("cpu", "actionopd"): {"batch_size": 8},
}
# Method settings a preset may not override (they define the method, not the machine).
_PRESET_KEEPS_METHOD = {"sft": {"learning_rate", "batch_size"}}
# Fields that are not the paper's setting of a run (where it reads and writes, engineering knobs that leave the
# losses unchanged): ``departures_of`` does not compare them with the paper preset.
_NOT_A_PAPER_SETTING = {"method", "preset", "student", "teacher", "student_model_preset", "teacher_model_preset",
                        "games", "generated_train_games", "seed", "checkpoint_every", "keep_checkpoints",
                        "logits_chunk_size", "max_supervised_tokens", "page_size", "prefix_sharing", "eval_every",
                        "eval_split", "advantage_logp"}
_METHOD_ONLY_FIELDS = {"collection_tasks": "actionopd", "num_candidates": "actionopd",
                       "num_teacher_samples": "actionopd", "match_bonus_scale": "actionopd",
                       "teacher_temperature": "actionopd", "teacher_top_p": "actionopd",
                       "fast_action_tokens": "actfirst"}
"""Fields only one method (family) reads: not a departure of the others."""


def check_exact_top_k(k: int, vocab_size: int, whose: str) -> None:
    """``ValueError`` unless the opd-exact loss's top K leaves a rest of the ``vocab_size``-token vocabulary."""
    if k >= vocab_size:
        raise ValueError(f"RunConfig.exact_top_k {k} is not below {whose} vocabulary of {vocab_size:,} ids (the "
                         "top K ids and the rest of them); for every id, leave exact_top_k unset")


def check_task_source(config: RunConfig, *, evaluate: bool = True) -> None:
    """The checks that need the task source but not its games built: ``ValueError`` when ``$ALFWORLD_DATA`` names
    official games that hold no solvable game in the training split (or, with ``evaluate``, the evaluation split),
    or when ``train_tasks`` exceeds the training tasks there are (official games, ScienceWorld; generated games are
    checked by ``RunConfig`` itself). Reads the environment and, for official games, the game index (no engine)."""
    import os

    from jaxopd.methods.benchmarks import ALFWORLD_DATA_ENV, TRAIN_SPLIT, official_games_root

    splits = [TRAIN_SPLIT[config.benchmark]] + ([config.resolved_eval_split] if evaluate else [])
    if config.benchmark == "scienceworld":
        from jaxopd_envs.scienceworld import scienceworld_split
        available = len(scienceworld_split("train"))
        where = "ScienceWorld"
    else:
        root = official_games_root(config.games)
        if root is None:                                                    # generated games
            if config.train_tasks is not None and config.train_tasks > config.generated_train_games:
                raise ValueError(f"RunConfig.train_tasks {config.train_tasks} exceeds the "
                                 f"{config.generated_train_games} generated ALFWorld training games "
                                 "(generated_train_games)")
            return
        data = os.environ[ALFWORLD_DATA_ENV]
        from jaxopd_envs.alfworld import data_dir_of, discover_games
        counts = {}
        for split in dict.fromkeys(splits):
            try:
                counts[split] = len(discover_games(root, split))
            except ValueError as error:          # an unreadable game file
                raise ValueError(f"${ALFWORLD_DATA_ENV}={data!r}: {error}") from None
            if not counts[split]:
                raise ValueError(f"${ALFWORLD_DATA_ENV}={data!r} holds no solvable ALFWorld games of the {split} "
                                 f"split (looked under {str(data_dir_of(root))!r}); point it at the official games "
                                 "(json_2.1.1) or unset it to use generated games")
        available = counts[splits[0]]
        where = f"the official ALFWorld train split under ${ALFWORLD_DATA_ENV}"
    if config.train_tasks is not None and config.train_tasks > available:
        raise ValueError(f"RunConfig.train_tasks {config.train_tasks} exceeds the {available} training tasks of "
                         f"{where}")


def minimal_prompt_tokens(benchmark: str, tokenizer: Any, modes: tuple[str, ...] = ("full",)) -> int:
    """The tokens of the shortest prompt a turn can have in ``modes``: the benchmark's system prompt and the
    template of a first turn whose instruction, observation and action lists are one word each (App. B.2 never cuts
    them, so no prompt budget below this can hold any turn)."""
    from jaxopd.rollout.prompts import PromptInputs, render_prompt

    inputs = PromptInputs(benchmark=benchmark, instruction="x", history=(), observation="x",
                          admissible_actions=("look",), action_templates=("look around",), objects=("x",),
                          reference_next_observation="x")
    return max(len(render_prompt(tokenizer, mode, inputs, 1 << 30).token_ids) for mode in modes)


def check_prompt_fits(config: RunConfig, tokenizer: Any, *, evaluate: bool = True) -> None:
    """``ValueError`` when ``max_prompt_tokens`` (or, with ``evaluate``, ``eval_max_prompt_tokens``) is below
    :func:`minimal_prompt_tokens` under ``tokenizer``: no prompt could ever fit, every episode would end at its first
    turn and nothing would train."""
    modes = ("full", "next_action", "inverse_dynamics") if config.method.startswith("actfirst") else ("full",)
    least = minimal_prompt_tokens(config.benchmark, tokenizer, modes)
    limits = [("max_prompt_tokens", config.max_prompt_tokens)]
    if evaluate:
        limits.append(("eval_max_prompt_tokens", config.eval_max_prompt_tokens))
    for name, value in limits:
        if value < least:
            raise ValueError(f"RunConfig.{name} ({value}) is below the {least} tokens of the {config.benchmark} system "
                             "prompt and the template of an empty first turn: no prompt fits")


def departures_of(config: RunConfig) -> tuple[str, ...]:
    """Every way a run of ``config`` departs from its method's paper, in words: the fields in which it differs
    from the ``paper`` preset of its method (the preset's sizing and the user's overrides), random-initialised
    models, and what this implementation does differently on every preset."""
    if config.method == "sft":
        return ("supervised fine-tuning of a teacher on demonstrations: no paper's setting (this project's way to "
                "make a teacher without a download)",)
    out: list[str] = []
    for role in ("student", "teacher"):
        if getattr(config, role) is None:
            out.append(f"{role}: random-initialised `{getattr(config, f'{role}_model_preset')}` weights (the papers "
                       "distil Qwen3 checkpoints)")
    paper = build_config(config.method, preset="paper", benchmark=config.benchmark)
    for field in dataclasses.fields(config):
        name = field.name
        mine, theirs = getattr(config, name), getattr(paper, name)
        reader = _METHOD_ONLY_FIELDS.get(name)
        if reader is not None and not config.method.startswith(reader):
            continue
        if name not in _NOT_A_PAPER_SETTING and mine != theirs:
            out.append(f"{name}: {_show(mine)} (paper preset: {_show(theirs)})")
    method, loss = config.method, config.resolved_loss
    if loss in ADVANTAGE_KINDS and config.advantage_logp == "current":
        out.append("advantage: -(log π_θ - log π_T) from the current forward pass (the formula of ActFirst-OPD "
                   "App. B.4 / STI-OPD App. B.3); Trinity-RFT, which the papers trained with, takes the stored "
                   "sampling log-probs (advantage_logp 'sampled')")
    if method == "sti":
        out.append(f"batch: {config.batch_size} turn-level responses per update; STI-OPD's Table 4 batch of 32 is 32 "
                   "training tasks per step (one rollout each, every turn of it), so an update here sees fewer "
                   "episodes (the loop batches turns, as ActFirst-OPD's)")
        out.append("prompts: ActFirst-OPD's App. B.1 templates; STI-OPD's own (App. B.4: its ALFWorld / ScienceWorld "
                   "system prompts, 'Observation:'-prefixed user turns, the reminder after 'Nothing happens.') are "
                   "not implemented")
        out.append(f"responses: the App. B.3 thinking budget ({config.first_stage_tokens:,} / {config.total_tokens:,} "
                   f"tokens) and {config.max_prompt_tokens:,}-token prompts; STI-OPD Table 4: up to 32,768 tokens a "
                   "turn in a 40,960-token context")
    if method == "actionopd":
        out.append(f"teacher responses: at most {config.total_tokens:,} tokens, the student's limit (ActionOPD "
                   "Table 8: 8k for the teacher; the teacher's engine is sized by the student's limits)")
        out.append("prompts: ActFirst-OPD's App. B.1 think-then-act templates on ALFWorld / ScienceWorld (ActionOPD "
                   "trains on tool-use benchmarks with their native prompts)")
    return tuple(out)


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return repr(list(value) if isinstance(value, tuple) else value)


CONFIG_FILE_SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def read_config_file(path: Any) -> dict[str, Any]:
    """The ``RunConfig`` fields a config file sets (``--config FILE``): a TOML, YAML or JSON mapping of field names
    to values (a run's own ``config.json`` is one), ``method`` and ``preset`` included. ``ValueError`` names a file
    that cannot be read or parsed, a value that is not a mapping, and every unknown field (``departures``, which a
    saved config carries but which follows from the fields, is ignored)."""
    from pathlib import Path

    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in CONFIG_FILE_SUFFIXES:
        raise ValueError(f"config file {str(path)!r}: expected a {' / '.join(CONFIG_FILE_SUFFIXES)} file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"config file {str(path)!r} cannot be read: {error}") from None
    try:
        if suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            try:
                import yaml
            except ImportError:
                raise ValueError(f"config file {str(path)!r}: reading YAML needs PyYAML (pip install pyyaml); "
                                 "TOML and JSON need nothing") from None
            data = yaml.safe_load(text)
    except ValueError as error:                     # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise ValueError(f"config file {str(path)!r} is not valid {suffix[1:].upper()}: {error}") from None
    except Exception as error:                      # yaml.YAMLError
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of RunConfig fields, got "
                         f"{type(data).__name__}")
    names = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(k for k in data if k not in names and k != "departures")
    if unknown:
        raise ValueError(f"config file {str(path)!r}: unknown RunConfig fields {unknown}")
    values = {k: v for k, v in data.items() if k != "departures"}
    if isinstance(values.get("eval_seeds"), list):
        values["eval_seeds"] = tuple(values["eval_seeds"])
    return values


def build_config(method: str, *, preset: str = "paper", **overrides: Any) -> RunConfig:
    """Shared defaults, then ``METHOD_DEFAULTS[method]``, then ``PRESET_OVERRIDES[preset]``, then ``overrides``
    (None values are ignored, so argparse defaults pass through; so is ``departures``, which a saved config's dict
    carries but which follows from the other fields)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    method_defaults = METHOD_DEFAULTS.get(method, {})
    keep = _PRESET_KEEPS_METHOD.get(method, set())
    preset_values = {k: v for k, v in PRESET_OVERRIDES[preset].items() if k not in keep}
    values: dict[str, Any] = {**method_defaults, **preset_values,
                              **PRESET_METHOD_OVERRIDES.get((preset, method), {})}
    values.update({k: v for k, v in overrides.items() if v is not None and k != "departures"})
    return RunConfig(method=method, preset=preset, **values)


__all__ = ["CONFIG_FILE_SUFFIXES", "read_config_file", "METHODS", "PRESETS", "ROLLOUT_MODES", "SFT_DEMONSTRATIONS",
           "SFT_THINKING", "DEFAULT_LOSSES", "RunConfig", "METHOD_DEFAULTS", "PRESET_OVERRIDES",
           "PRESET_METHOD_OVERRIDES", "build_config", "check_exact_top_k", "check_task_source",
           "minimal_prompt_tokens", "check_prompt_fits", "departures_of"]
