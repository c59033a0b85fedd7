"""The one configuration of a training run, its presets and each method's paper defaults.

Owns ``RunConfig`` (every knob of a run: method, benchmark, models, schedule, optimisation, generation, engine,
evaluation), the presets ``cpu`` / ``gpu`` / ``paper`` that size a run to a machine, and the order in which
a config is built: the shared defaults (ActFirst-OPD Table 6), then the method's paper defaults (STI-OPD's
setup table, ActionOPD Tables 7-8), then the preset, then the user's overrides. A config is printed at the start
of a run and saved with it (``config.json``); resuming checks that the saved one matches.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jaxopd.methods.benchmarks import BENCHMARKS, EVAL_SPLITS, GAME_SOURCES, GeneratedCounts
from jaxopd.rollout.tags import ACTION_FORMATS
from jaxopd.train.step import LR_SCHEDULES

METHODS = ("vanilla-opd", "actfirst", "actfirst-no-id", "actfirst-no-nap-fallback", "actfirst-prefix-replay-50",
           "actfirst-prefix-replay-100", "sti", "actionopd", "sft")
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
"""What SFT imitates, each with the ``envs.references`` kind of its references: the planner's walkthrough (it knows
where everything lies; ScienceWorld's gold path), or ALFWorld's searching expert (``envs.alfworld_expert``: it looks
for objects from what it has seen, as an agent on an unseen game must)."""


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
    # SFT (the teacher): epochs over the demonstration turns, which demonstrations (SFT_DEMONSTRATIONS), and the
    # weight of the language-model term on the prompt tokens (0: the response only)
    sft_epochs: float = 3.0
    sft_demonstrations: str = "walkthrough"
    sft_context_weight: float = 0.0          # > 0: a language-model term on the prompt tokens too (sft.train_sft)
    sft_thinking: str = "none"               # SFT_THINKING: SFT's answers, and distillation's held-out answers
    sft_renamed_copies: int = 0              # copies of each demonstration, classes renamed (envs.alfworld_names)
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
                    "page_size")
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
        if not self.eval_seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.eval_seeds):
            raise ValueError(f"RunConfig.eval_seeds must be a non-empty tuple of integers, got {self.eval_seeds!r}")
        object.__setattr__(self, "eval_seeds", tuple(self.eval_seeds))
        if self.dual_clip <= 1:
            raise ValueError(f"RunConfig.dual_clip must be > 1, got {self.dual_clip}")

    @property
    def resolved_eval_split(self) -> str:
        return self.eval_split or EVAL_SPLITS[self.benchmark][-1]

    def backlog_limit(self) -> int | None:
        """The samples the async runners may keep ahead of the trainer (``rollout_backlog`` resolved; None: no
        bound)."""
        if self.rollout_backlog is None:
            return self.batch_size * (self.max_version_lag + 1)
        return self.rollout_backlog or None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown RunConfig fields {unknown}")
        values = dict(data)
        if "eval_seeds" in values:
            values["eval_seeds"] = tuple(values["eval_seeds"])
        return cls(**values)

    def describe(self) -> str:
        """The config as aligned ``name = value`` lines (printed at the start of a run)."""
        data = self.to_dict()
        width = max(len(k) for k in data)
        return "\n".join(f"  {k.ljust(width)} = {data[k]!r}" for k in sorted(data))


# Each method's paper settings that differ from the shared (ActFirst-OPD Table 6) ones.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    # STI-OPD setup table: 200 steps, batch 32 prompts (ALFWorld, ScienceWorld), lr 1e-6, clip 1.0, T 1.0, top-p 1.0
    "sti": {"updates": 200, "batch_size": 32},
    # ActionOPD Tables 7-8: 100 collection steps of 64 task starts, N=4, K=3, lambda 0.5, minibatch 32, one epoch,
    # student T 0.6 / top-p 0.95 / top-k 20, teacher T 0.6 / top-p 0.95, 20 decisions (its ALFWorld-like limit)
    "actionopd": {"updates": 100, "batch_size": 32, "collection_tasks": 64, "temperature": 0.6, "top_p": 0.95,
                  "top_k": 20, "max_turns": 20},
    # supervised fine-tuning of the teacher on walkthroughs (no paper: our own CPU teacher)
    "sft": {"learning_rate": 1e-3, "weight_decay": 0.0, "batch_size": 16},
}

# Preset sizing. ``paper`` is the papers' setting; ``gpu`` one GPU; ``cpu`` a 2-core machine (tiny models,
# short responses, a few updates; its thinking budget, 48 of 64 tokens, holds the state thinking of the SFT
# teacher, whose longest response is 44 tokens); each also names the models a run uses without checkpoint folders.
PRESET_OVERRIDES: dict[str, dict[str, Any]] = {
    "paper": {},
    "gpu": {"rollout_slots": 16, "max_prompt_tokens": 4096, "max_train_tokens": 5120, "updates": 100,
            "student_model_preset": "qwen3-0.6b", "teacher_model_preset": "qwen3-1.7b", "eval_tasks": 134},
    "cpu": {"rollout_slots": 4, "batch_size": 16, "collection_tasks": 4, "updates": 20, "checkpoint_every": 5,
            "max_prompt_tokens": 1024, "max_train_tokens": 1152, "first_stage_tokens": 48, "total_tokens": 64,
            "second_stage_tokens": 16, "fast_action_tokens": 24, "max_turns": 20, "logits_chunk_size": None,
            "max_supervised_tokens": 80,
            "student_model_preset": "tiny", "teacher_model_preset": "tiny", "eval_tasks": 12,
            "learning_rate": 1e-5},
}
# Method settings a preset may not override (they define the method, not the machine).
_PRESET_KEEPS_METHOD = {"sft": {"learning_rate", "batch_size"}}


def build_config(method: str, *, preset: str = "paper", **overrides: Any) -> RunConfig:
    """Shared defaults, then ``METHOD_DEFAULTS[method]``, then ``PRESET_OVERRIDES[preset]``, then ``overrides``
    (None values are ignored, so argparse defaults pass through)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    method_defaults = METHOD_DEFAULTS.get(method, {})
    keep = _PRESET_KEEPS_METHOD.get(method, set())
    preset_values = {k: v for k, v in PRESET_OVERRIDES[preset].items() if k not in keep}
    values: dict[str, Any] = {**method_defaults, **preset_values}
    if preset == "cpu" and method == "actionopd":
        values["batch_size"] = 8
    values.update({k: v for k, v in overrides.items() if v is not None})
    return RunConfig(method=method, preset=preset, **values)


__all__ = ["METHODS", "PRESETS", "ROLLOUT_MODES", "SFT_DEMONSTRATIONS", "SFT_THINKING", "RunConfig", "METHOD_DEFAULTS",
           "PRESET_OVERRIDES", "build_config"]
