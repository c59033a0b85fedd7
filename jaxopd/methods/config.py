"""The configuration of a training run: a distillation config and an SFT config over a common base, their presets
and each method's paper defaults.

Owns ``RunConfig`` (the settings every run has: benchmark, student, schedule, optimiser, prompt and evaluation
limits), ``DistillConfig`` (the distillation methods: teacher, rollouts, losses, sampling, ActionOPD) and
``SFTConfig`` (supervised fine-tuning on demonstrations), each field with its command-line help in its metadata
(``experiments.train`` makes its flags from them); the presets ``cpu`` / ``gpu`` / ``paper`` and the order in which
``build_config`` builds a config: the shared defaults (ActFirst-OPD Table 6), the method's paper defaults, the
preset, the user's overrides. ``departures_of`` lists how a run departs from its paper; ``read_config_file`` reads
``--config FILE``; ``check_task_source`` and ``check_prompt_fits`` are the checks that need the environment or a
tokenizer. A check that refuses a value raises ``ValueError`` naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from jaxopd.losses import ADVANTAGE_LOGP
from jaxopd.methods.benchmarks import BENCHMARKS, EVAL_SPLITS, GAME_SOURCES, GeneratedCounts
from jaxopd.models.decoder import PRESETS as MODEL_PRESETS
from jaxopd.train.state import LR_SCHEDULES
from jaxopd.train.step import ADVANTAGE_KINDS, LOSS_KINDS

DISTILL_METHODS = ("vanilla-opd", "actfirst", "actfirst-no-id", "actfirst-no-nap-fallback",
                   "actfirst-prefix-replay-50", "actfirst-prefix-replay-100", "sti", "actionopd")
METHODS = DISTILL_METHODS + ("sft",)
DEFAULT_LOSSES = {"sti": "sti-opd", "actionopd": "action-opd", "sft": "sft"}
"""Each method's own loss (every other method: ``opd``); ``resolved_loss``."""
_MAX_SEED = 2**32 - 2          # the teacher's random init takes seed + 1; both must be a uint32
PRESETS = ("cpu", "gpu", "paper")
ROLLOUT_MODES = ("async", "sync")
SFT_THINKING = ("none", "plan")
"""What an SFT demonstration thinks before its action, in the full think-then-act answer: ``none`` (an empty
thinking block) or ``plan`` (ALFWorld: a short thinking written by a rule from what the prompt shows, the state of
the task and the step it calls for, ``jaxopd.methods.sft_data.plan_text``)."""
SFT_DEMONSTRATIONS = {"walkthrough": "solution", "searching-expert": "searching_expert"}
"""What SFT imitates, each with the ``jaxopd_envs.references`` kind of its references: the planner's walkthrough (it
knows where everything lies; ScienceWorld's gold path), or ALFWorld's searching expert (``jaxopd_envs.alfworld_expert``:
it looks for objects from what it has seen, as an agent on an unseen game must)."""


TUPLE_FIELDS = ("eval_seeds", "student_layers", "lora_layers")     # JSON / TOML / YAML give them as lists


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A config field with its command-line help (and ``choices`` / ``metavar`` for the flag) in its metadata: the
    one owner of a flag's text (``experiments.train.build_parser`` makes every flag from the fields)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The settings every run has, distillation or SFT (``DistillConfig``, ``SFTConfig``; build one with
    ``build_config``). Defaults are ActFirst-OPD's Table 6 unless a method's paper says otherwise
    (``METHOD_DEFAULTS``). Evaluation during training (``eval_*``) has its own limits: App. C.4's 30 turns, 1,920 /
    2,048 thinking tokens and 20,480 prompt tokens; every method is evaluated by that protocol.

    ``departures``: every way the run departs from its method's paper, in words; ``describe()`` prints them and
    ``to_dict()`` (so ``config.json``) carries them.
    """

    method: str = setting("actfirst", "the training method", choices=METHODS)
    benchmark: str = setting("alfworld", "the benchmark", choices=BENCHMARKS)
    preset: str = setting("paper", "machine sizing (the command's default: cpu)", choices=PRESETS)
    games: str = setting("auto", "ALFWorld's games: official ones under $ALFWORLD_DATA, generated ones, or auto "
                                 "(official if $ALFWORLD_DATA is set)", choices=GAME_SOURCES)
    generated_train_games: int = setting(GeneratedCounts.train, "generated ALFWorld games of the train split "
                                         "(valid_unseen stays the same games, valid_seen can change)", metavar="N")
    student: str | None = setting(None, "Hugging Face model folder of the student", metavar="DIR")
    student_model_preset: str = setting("qwen3-1.7b", "random-initialised student when no --student (with the "
                                        "offline Qwen3 tokenizer, so a Qwen3 preset)")
    student_layers: tuple[int, ...] = setting((), "cut the --student model to these of its decoder layers, in "
                                              "order (a smaller student from pretrained weights; empty: all)",
                                              metavar="I")
    lora_rank: int = setting(0, "train LoRA adapters of this rank on every attention and MLP projection over the "
                                "frozen student, and export them as an adapter folder (0: train the whole model)",
                             metavar="R")
    lora_alpha: float = setting(32.0, "LoRA's scale numerator: a weight's update is alpha / rank · A B")
    lora_layers: tuple[int, ...] = setting((), "the student's layers that get LoRA adapters (the upper ones spare "
                                           "the backward pass below them; empty: every layer)", metavar="I")
    # schedule
    updates: int = setting(250, "optimizer updates (distillation; ActionOPD: collection steps); SFT: --steps")
    batch_size: int = setting(64, "turn-level samples per update")
    rollout_slots: int = setting(16, "episodes played concurrently (the papers' 16 runners; evaluations too)")
    train_tasks: int | None = setting(None, "train on a seeded subset of this many tasks")
    checkpoint_every: int = setting(10, "updates between checkpoints")
    keep_checkpoints: int = setting(3, "newest checkpoints kept")
    seed: int = setting(42, "seed of the models' initialisation, the task order and the sampling")
    # optimisation (AdamW)
    learning_rate: float = setting(1e-6, "AdamW learning rate")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "global gradient-norm clip")
    max_train_tokens: int = setting(16_384, "longest turn-level sample trained on (prompt + response)")
    # generation
    max_turns: int = setting(30, "turn limit of a training episode (SFT: of the searching expert)")
    max_prompt_tokens: int = setting(10_240, "prompt limit (App. B.2 truncates the history to it)")
    total_tokens: int = setting(512, "thinking budget's total: the longest response")
    second_stage_tokens: int = setting(128, "thinking budget's second stage (after the early-stop text)")
    # engine
    page_size: int = setting(16, "KV-cache page size of the engines, in tokens")
    prefix_sharing: bool = setting(True, "share the KV pages of common prompt prefixes")
    # evaluation
    eval_split: str | None = setting(None, "evaluation split (default: the benchmark's unseen one)")
    eval_tasks: int | None = setting(None, "evaluate on a seeded subset of this many tasks (default: all)")
    eval_every: int = setting(0, "updates between evaluations (0: before and after training only)")
    eval_seeds: tuple[int, ...] = setting((42, 43, 44), "evaluation seeds (the first only between start and end)",
                                          metavar="SEED")
    eval_greedy: bool = setting(False, "evaluate with greedy decoding (on) or sampling at --eval-temperature (off); "
                                "default: the method's paper (ActionOPD greedy, the others at 0.4)")
    eval_temperature: float = setting(0.4, "evaluation temperature (ActFirst-OPD App. C)")
    eval_max_turns: int = setting(30, "turn limit of the evaluations (App. C.4's 30; cpu preset 20)")
    eval_max_prompt_tokens: int = setting(20_480, "prompt limit of the evaluations (App. C.4's 20,480; gpu preset "
                                          "4,096, cpu 1,024)")
    eval_first_stage_tokens: int = setting(1_920, "thinking budget's first stage in evaluations (App. C.4's 1,920; "
                                           "cpu preset 48)")
    eval_total_tokens: int = setting(2_048, "thinking budget's total in evaluations (App. C.4's 2,048; cpu preset "
                                     "64)")
    # the answers' format: SFT's demonstrations, and distillation's held-out answers (exact reverse KL)
    sft_thinking: str = setting("none", "what a demonstration (and a held-out answer) thinks before its action: "
                                "none (an empty thinking block) or plan (ALFWorld: the task's state and the step it "
                                "calls for, a short rule-written thinking)", choices=SFT_THINKING)

    METHODS = METHODS           # the methods this class configures (a class attribute, not a field)
    POSITIVE = ("generated_train_games", "updates", "batch_size", "rollout_slots", "checkpoint_every",
                "keep_checkpoints", "max_train_tokens", "max_turns", "max_prompt_tokens", "total_tokens",
                "page_size", "eval_max_turns", "eval_max_prompt_tokens", "eval_first_stage_tokens",
                "eval_total_tokens")
    POSITIVE_OR_NONE = ("train_tasks", "eval_tasks")
    NON_NEGATIVE = ("eval_every", "second_stage_tokens")
    ABOVE_ZERO = ("learning_rate", "max_grad_norm")
    AT_LEAST_ZERO = ("eval_temperature", "weight_decay")
    IN_UNIT = ()

    def __post_init__(self):
        name = type(self).__name__
        if type(self) is RunConfig:
            raise TypeError("RunConfig holds the settings every run shares; build a DistillConfig or an SFTConfig "
                            "(build_config chooses by method)")
        for field in dataclasses.fields(self):
            if field.type == "float":
                value = getattr(self, field.name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{name}.{field.name} must be a finite number, got {value!r}")
        if self.method not in self.METHODS:
            raise ValueError(f"unknown {name} method {self.method!r}; expected one of {self.METHODS}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"{name}.lora_rank must be an integer >= 0 (0: the whole model), got {self.lora_rank!r}")
        if self.lora_rank and self.student is None:
            raise ValueError(f"{name}.lora_rank: LoRA adapters adapt a pretrained --student folder; a random-"
                             "initialised student trains whole (lora_rank 0)")
        if self.lora_rank and not self.lora_alpha > 0:
            raise ValueError(f"{name}.lora_alpha must be > 0, got {self.lora_alpha!r}")
        lora_layers = tuple(self.lora_layers)
        object.__setattr__(self, "lora_layers", lora_layers)
        if lora_layers:
            if not self.lora_rank:
                raise ValueError(f"{name}.lora_layers places LoRA adapters; set lora_rank too")
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in lora_layers) \
                    or list(lora_layers) != sorted(set(lora_layers)):
                raise ValueError(f"{name}.lora_layers must be increasing layer indices, each once, got "
                                 f"{list(lora_layers)}")
        layers = tuple(self.student_layers)
        object.__setattr__(self, "student_layers", layers)
        if layers and (self.student is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in layers) or list(layers) != sorted(set(layers))):
            raise ValueError(f"{name}.student_layers must be increasing layer indices, each once, of a --student "
                             f"folder's model, got {list(layers)}" + ("" if self.student else " without a student"))
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.benchmark!r}; expected one of {BENCHMARKS}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {PRESETS}")
        if self.games not in GAME_SOURCES:
            raise ValueError(f"unknown game source {self.games!r}; expected one of {GAME_SOURCES}")
        if self.generated_train_games != GeneratedCounts.train and (self.benchmark != "alfworld"
                                                                    or self.games == "official"):
            raise ValueError(f"generated_train_games={self.generated_train_games} sizes generated ALFWorld games; "
                             f"this run uses {self.benchmark} ({self.games} games)")
        for field in self.POSITIVE:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field} must be a positive integer, got {value!r}")
        for field in self.POSITIVE_OR_NONE:
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}.{field} must be a positive integer or None, got {value!r}")
        for field in self.NON_NEGATIVE:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}.{field} must be a non-negative integer, got {value!r}")
        for field in self.ABOVE_ZERO:
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)!r}")
        for field in self.AT_LEAST_ZERO:
            if not getattr(self, field) >= 0:
                raise ValueError(f"{name}.{field} must be >= 0, got {getattr(self, field)!r}")
        for field in self.IN_UNIT:
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"{name}.{field} must lie in (0, 1], got {getattr(self, field)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"{name}.seed must be an integer from 0 to {_MAX_SEED}, got {self.seed!r}")
        if self.eval_split is not None and self.eval_split not in EVAL_SPLITS[self.benchmark] + ("train",):
            raise ValueError(f"unknown {self.benchmark} evaluation split {self.eval_split!r}; expected one of "
                             f"{EVAL_SPLITS[self.benchmark]}")
        if not self.eval_seeds or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_SEED
                                          for s in self.eval_seeds):
            raise ValueError(f"{name}.eval_seeds must be a non-empty tuple of integers from 0 to {_MAX_SEED}, "
                             f"got {self.eval_seeds!r}")
        object.__setattr__(self, "eval_seeds", tuple(self.eval_seeds))
        if self.eval_first_stage_tokens > self.eval_total_tokens:
            raise ValueError(f"{name}.eval_first_stage_tokens ({self.eval_first_stage_tokens}) exceeds "
                             f"eval_total_tokens ({self.eval_total_tokens})")
        if self.benchmark == "scienceworld" and self.games != "auto":
            raise ValueError(f"{name}.games {self.games!r} chooses ALFWorld's game source (official or "
                             "generated); ScienceWorld has one, the scienceworld wheel's tasks")
        if (self.train_tasks is not None and self.benchmark == "alfworld" and self.games == "generated"
                and self.train_tasks > self.generated_train_games):
            raise ValueError(f"{name}.train_tasks {self.train_tasks} exceeds the {self.generated_train_games} "
                             "generated ALFWorld training games (generated_train_games)")
        if self.sft_thinking not in SFT_THINKING:
            raise ValueError(f"unknown SFT thinking {self.sft_thinking!r}; expected one of {SFT_THINKING}")
        if self.sft_thinking != "none" and self.benchmark != "alfworld":
            raise ValueError(f"{self.sft_thinking} thinking reads ALFWorld prompts; ScienceWorld SFT thinks nothing "
                             "(sft_thinking 'none')")
        self._check_models()
        self._check()

    def _model_roles(self) -> list[tuple[str, str | None, str]]:
        return [("student", self.student, self.student_model_preset)]

    def _check_models(self) -> None:
        """A random-initialised model (no folder) needs an architecture preset of ``jaxopd.models.decoder``."""
        for role, folder, preset in self._model_roles():
            if folder is None and str(preset).lower().replace("_", "-") not in MODEL_PRESETS:
                raise ValueError(f"{type(self).__name__}.{role}_model_preset {preset!r} is not a model preset (the "
                                 f"{role} is random-initialised without a {role} folder); choose one of "
                                 f"{sorted(MODEL_PRESETS)}")

    def _check(self) -> None:
        """The checks of the subclass's own fields."""

    @property
    def resolved_loss(self) -> str:
        """The loss the run trains: ``loss``, or the method's own."""
        return getattr(self, "loss", None) or DEFAULT_LOSSES.get(self.method, "opd")

    def lora_config(self) -> Any:
        """The ``jaxopd.models.lora.LoraConfig`` of ``lora_rank`` / ``lora_alpha``; None when the whole model trains."""
        if not self.lora_rank:
            return None
        from jaxopd.models.lora import LoraConfig
        return LoraConfig(rank=self.lora_rank, alpha=float(self.lora_alpha), layers=tuple(self.lora_layers) or None)

    @property
    def resolved_eval_split(self) -> str:
        return self.eval_split or EVAL_SPLITS[self.benchmark][-1]

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
        """The config of ``data`` (a ``to_dict``): an ``SFTConfig`` for method ``sft``, else a ``DistillConfig``
        (called on a subclass: that one)."""
        if cls is RunConfig:
            cls = config_class(data.get("method", "actfirst"))
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k != "departures"}      # derived, not a setting
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}")
        for field in TUPLE_FIELDS:
            if field in values:
                values[field] = tuple(values[field])
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


@dataclasses.dataclass(frozen=True)
class DistillConfig(RunConfig):
    """A distillation run (vanilla OPD, ActFirst-OPD and its ablations, STI-OPD, ActionOPD).

    Schedule: ``updates`` optimizer updates of ``batch_size`` turn-level responses each; samples older than
    ``max_version_lag`` versions are dropped. ActionOPD collects ``collection_tasks`` task starts with one policy
    snapshot, then trains one epoch of ``batch_size`` minibatches over them.

    ``rollout_mode``: ``async`` (the papers' pipeline: runners stream episodes into the buffer while the trainer
    steps, so which sample lands in which batch depends on thread timing) or ``sync`` (reproducible: between two
    updates the runners play waves of ``rollout_slots`` episodes in task order with the current weights).

    ``rollout_backlog`` (async): how many samples the runners may keep ahead of the trainer, counting the fresh
    samples buffered and, for each episode in flight or delivered but not yet buffered, the mean sample count of
    the episodes delivered so far (``max_turns`` before the first); a runner starts an episode only below it.
    None: ``batch_size * (max_version_lag + 1)``; 0: no bound. ``advantage_logp``: which student log-prob OPD's and
    STI-OPD's advantage reads (``jaxopd.train.step.LossConfig.advantage_logp``).
    """

    teacher: str | None = setting(None, "Hugging Face model folder of the teacher", metavar="DIR")
    teacher_model_preset: str = setting("qwen3-8b", "random-initialised teacher when no --teacher")
    collection_tasks: int = setting(64, "ActionOPD: task starts collected with one policy snapshot")
    max_version_lag: int = setting(1, "samples older than this many policy versions are dropped")
    rollout_mode: str = setting("async", "async: the papers' streaming runners; sync: waves in task order between "
                                "updates, reproducible (a killed and resumed run trains on the same batches, "
                                "with the same losses to float rounding)",
                                choices=ROLLOUT_MODES)
    rollout_backlog: int | None = setting(None, "async: samples the runners may keep ahead of the trainer (default: "
                                          "batch size x (max version lag + 1)); 0: no bound, runners never pause",
                                          metavar="SAMPLES")
    sync_check: bool = setting(False, "after each weight sync, every rollout engine decodes the greedy first token "
                               "of the batch's first prompt; the run stops if the engines disagree or serve another "
                               "version (logged as sync_check_token / sync_check_logprob)")
    clip_eps: float = setting(0.2, "the surrogate's ratio clip")
    dual_clip: float = setting(3.0, "the surrogate's dual clip (> 1)")
    loss: str | None = setting(None, "the loss instead of the method's own; opd-exact: vanilla OPD's reverse KL "
                               "computed over the whole vocabulary at each sampled state (not the papers' form; needs "
                               "--max-supervised-tokens)", choices=LOSS_KINDS)
    advantage_logp: str = setting("current", "opd / sti-opd losses: the student log-prob of the advantage -(log pi - "
                                  "log pi_T): current (the forward pass being trained) or sampled (the rollout's "
                                  "stored one, as Trinity-RFT computes it)", choices=ADVANTAGE_LOGP)
    exact_top_k: int | None = setting(None, "opd-exact only: carry the teacher's top K ids and the mass of the rest "
                                      "at each state instead of its whole log-softmax (a lower bound of the exact "
                                      "reverse KL; for large vocabularies such as Qwen3's, e.g. 64); default: all ids",
                                      metavar="K")
    logits_chunk_size: int | None = setting(1024, "positions per chunk of the step's logits (memory)")
    max_supervised_tokens: int | None = setting(None, "project only this many response positions in the step")
    remat_layers: bool = setting(False, "recompute each layer's activations in the step's backward pass (the same "
                                 "gradient for about one more forward pass; memory for larger batches)")
    first_stage_tokens: int = setting(384, "thinking budget's first stage (App. B.3)")
    fast_action_tokens: int = setting(512, "ActFirst-OPD: the fast action-only request's token limit")
    temperature: float = setting(1.0, "rollout sampling temperature")
    top_p: float = setting(1.0, "rollout nucleus sampling")
    top_k: int = setting(0, "rollout top-k sampling (0: off)")
    # ActionOPD (Tables 7-8)
    num_candidates: int = setting(4, "ActionOPD: student candidates per decision (N)")
    num_teacher_samples: int = setting(3, "ActionOPD: teacher samples per decision (K)")
    match_bonus_scale: float = setting(0.5, "ActionOPD: agreement-reward bonus (lambda)")
    teacher_temperature: float = setting(0.6, "ActionOPD: teacher sampling temperature")
    teacher_top_p: float = setting(0.95, "ActionOPD: teacher nucleus sampling")

    METHODS = DISTILL_METHODS
    POSITIVE = RunConfig.POSITIVE + ("collection_tasks", "first_stage_tokens", "fast_action_tokens",
                                     "num_candidates", "num_teacher_samples")
    POSITIVE_OR_NONE = RunConfig.POSITIVE_OR_NONE + ("logits_chunk_size", "max_supervised_tokens", "exact_top_k")
    NON_NEGATIVE = RunConfig.NON_NEGATIVE + ("max_version_lag", "top_k")
    ABOVE_ZERO = RunConfig.ABOVE_ZERO + ("clip_eps", "dual_clip")
    AT_LEAST_ZERO = RunConfig.AT_LEAST_ZERO + ("temperature", "teacher_temperature", "match_bonus_scale")
    IN_UNIT = ("top_p", "teacher_top_p")

    def _model_roles(self) -> list[tuple[str, str | None, str]]:
        return super()._model_roles() + [("teacher", self.teacher, self.teacher_model_preset)]

    def _check(self) -> None:
        if self.rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"unknown rollout mode {self.rollout_mode!r}; expected one of {ROLLOUT_MODES}")
        if self.rollout_backlog is not None and (isinstance(self.rollout_backlog, bool)
                                                 or not isinstance(self.rollout_backlog, int)
                                                 or self.rollout_backlog < 0):
            raise ValueError(f"DistillConfig.rollout_backlog must be a non-negative integer or None, "
                             f"got {self.rollout_backlog!r}")
        if self.dual_clip <= 1:
            raise ValueError(f"DistillConfig.dual_clip must be > 1, got {self.dual_clip}")
        if self.first_stage_tokens > self.total_tokens:
            raise ValueError(f"DistillConfig.first_stage_tokens ({self.first_stage_tokens}) exceeds total_tokens "
                             f"({self.total_tokens})")
        if self.exact_top_k is not None and self.student is None:
            vocab = MODEL_PRESETS[self.student_model_preset.lower().replace("_", "-")].vocab_size
            check_exact_top_k(self.exact_top_k, vocab, f"the {self.student_model_preset} student's")
        self._check_loss()
        self._check_token_limits()

    def _check_loss(self) -> None:
        """A loss flag that would train nothing, or something other than the method says, is refused."""
        own = DEFAULT_LOSSES.get(self.method, "opd")
        if self.loss is not None and self.loss not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.loss!r}; expected one of {LOSS_KINDS}")
        if self.loss == "sft":
            raise ValueError(f"DistillConfig.loss 'sft' trains on demonstrations; {self.method} distils from its "
                             f"rollouts (its loss: {own}); for SFT use --method sft")
        if self.loss == "opd-exact" and self.method not in ("vanilla-opd", "actfirst"):
            raise ValueError(f"the opd-exact loss replaces the sampled reverse KL of vanilla OPD and ActFirst-OPD; "
                             f"{self.method} trains its own objective")
        if self.exact_top_k is not None and self.loss != "opd-exact":
            raise ValueError("exact_top_k sizes the opd-exact loss's teacher distribution; pass --loss opd-exact")
        if self.loss == "action-opd" and self.method != "actionopd":
            raise ValueError(f"DistillConfig.loss 'action-opd' reads ActionOPD's group advantages, which only the "
                             f"actionopd method's rollouts carry; on {self.method}'s samples they are 0, and so are "
                             f"its loss and gradient (its loss: {own})")
        if self.method == "actionopd" and self.loss not in (None, "action-opd"):
            raise ValueError(f"DistillConfig.loss {self.loss!r}: ActionOPD's candidates are trained by its "
                             "agreement-reward objective (loss action-opd); its teacher is a black box")
        if self.advantage_logp not in ADVANTAGE_LOGP:
            raise ValueError(f"DistillConfig.advantage_logp must be one of {ADVANTAGE_LOGP}, got "
                             f"{self.advantage_logp!r}")
        if self.advantage_logp != "current" and self.resolved_loss not in ADVANTAGE_KINDS:
            raise ValueError(f"DistillConfig.advantage_logp {self.advantage_logp!r} chooses the log-prob of the "
                             f"sampled reverse-KL advantage of the {' / '.join(ADVANTAGE_KINDS)} losses; "
                             f"{self.method} trains {self.resolved_loss}")

    def _check_token_limits(self) -> None:
        """Limits under which nothing could be trained on: every training sample is a prompt of at most
        ``max_prompt_tokens`` and a response of at most ``total_tokens``."""
        longest = self.max_prompt_tokens + self.total_tokens
        if self.max_train_tokens < longest:
            raise ValueError(f"DistillConfig.max_train_tokens ({self.max_train_tokens}) is below max_prompt_tokens + "
                             f"total_tokens ({self.max_prompt_tokens} + {self.total_tokens} = {longest}), the longest "
                             "turn-level sample; the samples of long prompts would be dropped")
        if self.max_supervised_tokens is not None and self.max_supervised_tokens < self.total_tokens:
            raise ValueError(f"DistillConfig.max_supervised_tokens ({self.max_supervised_tokens}) is below "
                             f"total_tokens ({self.total_tokens}): a whole response could not be trained on")

    def backlog_limit(self) -> int | None:
        """The samples the async runners may keep ahead of the trainer (``rollout_backlog`` resolved; None: no
        bound)."""
        if self.rollout_backlog is None:
            return self.batch_size * (self.max_version_lag + 1)
        return self.rollout_backlog or None


@dataclasses.dataclass(frozen=True)
class SFTConfig(RunConfig):
    """Supervised fine-tuning on demonstrations (``--method sft``: how a teacher is made here): ``sft_epochs`` over
    the demonstration turns of the training games, answered in the full think-then-act format (``sft_thinking``)
    and, with ``sft_fast_copies``, also as ActFirst-OPD's action-only requests."""

    method: str = setting("sft", "the training method", choices=METHODS)
    sft_epochs: float = setting(3.0, "epochs over the demonstration turns (when --steps is not given)")
    sft_demonstrations: str = setting("walkthrough", "what SFT imitates: the planner's walkthroughs, or ALFWorld's "
                                      "searching expert, which looks for objects from what it has seen (its won "
                                      "episodes only)", choices=tuple(SFT_DEMONSTRATIONS))
    sft_fast_copies: int = setting(0, "copies of every turn as ActFirst-OPD's action-only requests (next-action and "
                                   "inverse-dynamics prompts answered by the action tag alone), so that the model "
                                   "can act in ActFirst's rollouts", metavar="K")
    lr_schedule: str = setting("constant", "constant learning rate, or cosine (warm-up over 5 % of the steps, then "
                               "a half cosine down to a tenth)", choices=LR_SCHEDULES)
    sft_group_by_length: int = setting(0, "batches of samples of similar length (less padding, faster steps): each "
                                       "window of W batches of the epoch's shuffled order is sorted by length, cut, "
                                       "and its batches shuffled; 0: off", metavar="W")

    METHODS = ("sft",)
    NON_NEGATIVE = RunConfig.NON_NEGATIVE + ("sft_fast_copies", "sft_group_by_length")
    ABOVE_ZERO = RunConfig.ABOVE_ZERO + ("sft_epochs",)

    def _check(self) -> None:
        if self.sft_demonstrations not in SFT_DEMONSTRATIONS:
            raise ValueError(f"unknown SFT demonstrations {self.sft_demonstrations!r}; expected one of "
                             f"{tuple(SFT_DEMONSTRATIONS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.lr_schedule!r}; expected one of {LR_SCHEDULES}")
        if self.benchmark != "alfworld" and self.sft_demonstrations == "searching-expert":
            raise ValueError("the searching expert plays ALFWorld only; ScienceWorld SFT uses walkthrough (gold "
                             "path) demonstrations")
        if self.max_train_tokens <= self.max_prompt_tokens:
            raise ValueError(f"SFTConfig.max_train_tokens ({self.max_train_tokens}) leaves no room for a "
                             f"demonstration's answer after a prompt of max_prompt_tokens "
                             f"({self.max_prompt_tokens}); raise max_train_tokens or lower max_prompt_tokens")


def config_class(method: str) -> type[RunConfig]:
    """``SFTConfig`` for ``sft``, ``DistillConfig`` for a distillation method; ``ValueError`` for another name."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    return SFTConfig if method == "sft" else DistillConfig


def field_names(cls: type[RunConfig]) -> frozenset[str]:
    """The field names of a config class."""
    return frozenset(f.name for f in dataclasses.fields(cls))


ALL_FIELDS = field_names(DistillConfig) | field_names(SFTConfig)
"""Every field of either config (what a config file or a flag may set)."""


def field_owner(name: str) -> str:
    """Which kind of run reads field ``name``: ``distillation``, ``SFT`` or ``every run``."""
    if name in field_names(DistillConfig) and name in field_names(SFTConfig):
        return "every run"
    return "an SFT" if name in field_names(SFTConfig) else "a distillation"


# Each method's paper settings that differ from the shared (ActFirst-OPD Table 6) ones.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    # STI-OPD setup table: 200 steps, batch 32 prompts (ALFWorld, ScienceWorld), lr 1e-6, clip 1.0, T 1.0, top-p 1.0
    "sti": {"updates": 200, "batch_size": 32},
    # ActionOPD Tables 7-8: 100 collection steps of 64 task starts, N=4, K=3, lambda 0.5, minibatch 32, one epoch,
    # student T 0.6 / top-p 0.95 / top-k 20, teacher T 0.6 / top-p 0.95, 20 decisions (its ALFWorld-like limit);
    # Sec. 3.1: its students are evaluated with greedy decoding
    "actionopd": {"updates": 100, "batch_size": 32, "collection_tasks": 64, "temperature": 0.6, "top_p": 0.95,
                  "top_k": 20, "max_turns": 20, "eval_greedy": True},
    # supervised fine-tuning of a teacher on demonstrations (no paper: this project's way to make a teacher)
    "sft": {"learning_rate": 1e-3, "weight_decay": 0.0, "batch_size": 16},
}

# Preset sizing. ``paper`` is the papers' setting; ``gpu`` one GPU; ``cpu`` a 2-core machine (tiny models,
# short responses, a few updates); each also names the models a run uses without checkpoint folders. A preset sets
# only the fields the method's config has (``build_config``).
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
                        "logits_chunk_size", "max_supervised_tokens", "remat_layers", "page_size", "prefix_sharing",
                        "eval_every", "eval_split", "advantage_logp", "sft_thinking", "sync_check"}
_METHOD_ONLY_FIELDS = {"collection_tasks": "actionopd", "num_candidates": "actionopd",
                       "num_teacher_samples": "actionopd", "match_bonus_scale": "actionopd",
                       "teacher_temperature": "actionopd", "teacher_top_p": "actionopd",
                       "fast_action_tokens": "actfirst"}
"""Fields only one method (family) reads: not a departure of the others."""


def check_exact_top_k(k: int, vocab_size: int, whose: str) -> None:
    """``ValueError`` unless the opd-exact loss's top K leaves a rest of the ``vocab_size``-token vocabulary."""
    if k >= vocab_size:
        raise ValueError(f"DistillConfig.exact_top_k {k} is not below {whose} vocabulary of {vocab_size:,} ids (the "
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
                raise ValueError(f"{type(config).__name__}.train_tasks {config.train_tasks} exceeds the "
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
        raise ValueError(f"{type(config).__name__}.train_tasks {config.train_tasks} exceeds the {available} training "
                         f"tasks of "
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
            raise ValueError(f"{type(config).__name__}.{name} ({value}) is below the {least} tokens of the "
                             f"{config.benchmark} system prompt and the template of an empty first turn: no prompt "
                             "fits")


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
    """The config fields a config file sets (``--config FILE``): a TOML, YAML or JSON mapping of field names
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
        raise ValueError(f"config file {str(path)!r} must hold a mapping of config fields, got "
                         f"{type(data).__name__}")
    unknown = sorted(k for k in data if k not in ALL_FIELDS and k != "departures")
    if unknown:
        raise ValueError(f"config file {str(path)!r}: unknown config fields {unknown}")
    values = {k: v for k, v in data.items() if k != "departures"}
    for field in TUPLE_FIELDS:
        if isinstance(values.get(field), list):
            values[field] = tuple(values[field])
    return values


def build_config(method: str, *, preset: str = "paper", **overrides: Any) -> RunConfig:
    """The config of a ``method`` run (``config_class``): shared defaults, then ``METHOD_DEFAULTS[method]``, then
    ``PRESET_OVERRIDES[preset]`` (the fields the method's config has), then ``overrides`` (None values are ignored,
    so argparse defaults pass through; so is ``departures``, which a saved config's dict carries but which follows
    from the other fields). ``ValueError`` for an override the method's config does not have."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    cls = config_class(method)
    names = field_names(cls)
    given = {k: v for k, v in overrides.items() if v is not None and k != "departures"}
    for name, value in given.items():
        if name not in names:
            where = (f"{field_owner(name)} setting" if name in ALL_FIELDS else "not a config field")
            raise ValueError(f"{name} {value!r}: {name} is {where}; --method {method} does not read it")
    keep = _PRESET_KEEPS_METHOD.get(method, set())
    preset_values = {k: v for k, v in PRESET_OVERRIDES[preset].items() if k not in keep}
    values: dict[str, Any] = {**METHOD_DEFAULTS.get(method, {}), **preset_values,
                              **PRESET_METHOD_OVERRIDES.get((preset, method), {})}
    values = {k: v for k, v in values.items() if k in names}
    values.update(given)
    return cls(method=method, preset=preset, **values)


__all__ = ["CONFIG_FILE_SUFFIXES", "read_config_file", "METHODS", "DISTILL_METHODS", "PRESETS", "ROLLOUT_MODES",
           "SFT_DEMONSTRATIONS", "SFT_THINKING", "DEFAULT_LOSSES", "RunConfig", "DistillConfig", "SFTConfig",
           "ALL_FIELDS", "config_class", "field_names", "field_owner", "setting", "METHOD_DEFAULTS",
           "PRESET_OVERRIDES", "PRESET_METHOD_OVERRIDES", "build_config", "check_exact_top_k", "check_task_source",
           "minimal_prompt_tokens", "check_prompt_fits", "departures_of"]
