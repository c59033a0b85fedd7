"""Thinking-budget decoding of full responses (ActFirst-OPD App. B.3, after Qwen3's thinking-budget recipe).

Owns the two-request protocol and its early-stop text: a first request with a token budget; if it is cut
off before the action starts, the early-stop text is inserted (closing ``</think>`` only when reasoning is
still open) and a second request continues with at most the remaining budget. The result marks inserted
tokens as not model-generated, so they stay in the context but out of the loss and its normalisation.
``submit_budgeted`` returns a ``BudgetedFuture``: its ``request_id`` names the first stage (the second is
``request_id + "/stage2"``), and ``abort()`` or ``cancel()`` stops whichever stage runs.
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from jaxopd.rollout.tags import ACTION_END, ACTION_START, THINK_END
from jaxopd.sampler.types import Request, Result, SamplingParams, is_int

EARLY_STOP_SENTENCE = ("Considering the limited time by the user, I have to give the action based on the thinking "
                       "directly now.")
"""The early-stop instruction of App. B.3, "adapted to the action format" from Qwen3's thinking-budget text
("Considering the limited time by the user, I have to give the solution based on the thinking directly
now.", Qwen3 technical report §4.3 and Qwen's quickstart, which B.3 cites): "solution" becomes "action".
The paper's own box did not survive its text extraction (papers/actfirst-opd.txt, App. B.3), so this is
the one substitution its sentence names, nothing more."""


def early_stop_text(reasoning_ended: bool) -> str:
    """What is inserted when a full response hits its first-stage budget before its action started.

    Qwen's layout: ``"\\n\\n" + sentence + "\\n</think>\\n\\n"``; App. B.3: "If reasoning has already ended, the
    inserted text omits </think>" (and when the action has already started, nothing is inserted).
    """
    return f"\n\n{EARLY_STOP_SENTENCE}\n" + ("\n" if reasoning_ended else f"{THINK_END}\n\n")


@dataclasses.dataclass(frozen=True)
class ThinkingBudget:
    """Token limits. Training: 384 / 512; evaluation: 1,920 / 2,048; the second request makes <= 128."""

    first_stage_tokens: int = 384
    total_tokens: int = 512
    second_stage_max_tokens: int = 128

    def __post_init__(self):
        if not 0 < self.first_stage_tokens <= self.total_tokens:
            raise ValueError(f"need 0 < first_stage_tokens ({self.first_stage_tokens}) <= total_tokens "
                             f"({self.total_tokens})")
        if self.second_stage_max_tokens <= 0:
            raise ValueError(f"second_stage_max_tokens must be positive, got {self.second_stage_max_tokens}")


@dataclasses.dataclass(frozen=True)
class BudgetedResponse:
    """A full response: ``token_ids`` = first-stage + inserted + second-stage tokens.

    ``model_generated[i]`` is False for inserted tokens, whose ``logprobs`` entry is 0 and meaningless.
    ``truncated``: the response ran out of budget without closing its action (treated as an empty action).
    """

    token_ids: list[int]
    logprobs: np.ndarray
    model_generated: np.ndarray
    text: str
    truncated: bool
    stages: tuple[Result, ...]
    inserted_text: str = ""


def _insertion(text: str, early_stop_text: Callable[[bool], str]) -> str:
    """What to insert after a first stage cut off by its budget (App. B.3)."""
    if THINK_END not in text:
        return early_stop_text(False)             # still reasoning: close it
    if ACTION_START not in text.split(THINK_END)[-1]:
        return early_stop_text(True)              # reasoning ended, action not started
    return ""                                     # the action has started: continue as is


class BudgetedFuture(Future):
    """``Future[BudgetedResponse]`` of one budgeted response, with a handle on its engine requests.

    ``request_id``: the first stage's id (the second stage is ``request_id + "/stage2"``); ``request_ids``:
    the ids submitted so far. ``abort()`` aborts the stage that runs and prevents a second stage: the future
    then resolves with the stages so far (the last with ``finish_reason='abort'``). ``cancel()`` does the
    same and cancels this future.
    """

    def __init__(self, engine: Any, request_id: str):
        super().__init__()
        self.request_id = request_id
        self.request_ids: list[str] = []
        self._engine = engine
        self._lock = threading.Lock()
        self._aborted = False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            current = self.request_ids[-1] if self.request_ids else None
        if current is not None:
            self._engine.abort(current)

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self.abort()
        return cancelled

    def _submit_stage(self, request: Request) -> Future | None:
        """Submit a stage unless aborted (under the lock, so an abort either sees it or prevents it)."""
        with self._lock:
            if self._aborted:
                return None
            future = self._engine.submit(request)
            self.request_ids.append(request.request_id)
            return future

    def _resolve(self, value: Any = None, exc: BaseException | None = None) -> None:
        if self.done():            # cancelled by the caller
            return
        if exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(value)


def submit_budgeted(engine, tokenizer, prompt_ids: list[int], params: SamplingParams,
                    budget: ThinkingBudget = ThinkingBudget(), *, kind: str = "full", priority: int = 0,
                    early_stop_text: Callable[[bool], str] = early_stop_text,
                    request_id: str | None = None) -> BudgetedFuture:
    """Run budgeted decoding on ``engine`` without blocking; returns a ``BudgetedFuture`` (abortable).

    ``params.max_new_tokens`` is ignored (the budget sets it); stop conditions and sampling settings apply
    to both stages. ``request_id``: the first stage's id (default: a fresh one). ``ValueError`` at once when
    the prompt plus ``budget.total_tokens`` exceeds the engine's ``max_seq_len`` (the second stage's prompt
    holds the first stage's output, so only then are both stages sure to fit), or for any bad field.
    """
    if not isinstance(budget, ThinkingBudget):
        raise ValueError(f"budget must be a ThinkingBudget, got {type(budget).__name__}")
    max_seq_len = getattr(engine, "max_seq_len", None)
    if is_int(max_seq_len) and len(prompt_ids) + budget.total_tokens > max_seq_len:
        raise ValueError(f"prompt of {len(prompt_ids):,} tokens + thinking budget {budget.total_tokens:,} "
                         f"exceeds max_seq_len {max_seq_len:,}")
    if not isinstance(params, SamplingParams) or not is_int(params.min_new_tokens):
        raise ValueError(f"params must be SamplingParams with an integer min_new_tokens, got {params!r}")
    first_params = dataclasses.replace(params, max_new_tokens=budget.first_stage_tokens,
                                       min_new_tokens=min(params.min_new_tokens, budget.first_stage_tokens))
    first_request = Request(list(prompt_ids), first_params, kind=kind, priority=priority,
                            request_id=request_id or "")
    outer = BudgetedFuture(engine, first_request.request_id)

    def finish(stages: list[Result], inserted_ids: list[int], inserted_text: str) -> None:
        first = stages[0]
        ids = list(first.token_ids) + inserted_ids
        logprobs = list(first.logprobs) + [0.0] * len(inserted_ids)
        generated = [True] * len(first.token_ids) + [False] * len(inserted_ids)
        if len(stages) == 2:
            ids += stages[1].token_ids
            logprobs += list(stages[1].logprobs)
            generated += [True] * len(stages[1].token_ids)
        text = tokenizer.decode(ids)
        last = stages[-1]
        ran_out = last.finish_reason == "length" or (len(stages) == 1 and inserted_ids)
        truncated = bool(ran_out) and ACTION_END not in text.split(THINK_END)[-1]
        outer._resolve(BudgetedResponse(ids, np.asarray(logprobs, np.float32), np.asarray(generated, bool),
                                        text, truncated, tuple(stages), inserted_text))

    def on_second(first: Result, inserted_ids: list[int], inserted_text: str, fut: Future) -> None:
        try:
            finish([first, fut.result()], inserted_ids, inserted_text)
        except BaseException as exc:  # noqa: BLE001 - forwarded to the caller's future
            outer._resolve(exc=exc)

    def on_first(fut: Future) -> None:
        try:
            if fut.cancelled():
                return
            first = fut.result()
            if first.finish_reason != "length":
                return finish([first], [], "")
            inserted_text = _insertion(tokenizer.decode(first.token_ids), early_stop_text)
            inserted_ids = tokenizer.encode(inserted_text) if inserted_text else []
            remaining = budget.total_tokens - len(first.token_ids) - len(inserted_ids)
            second_max = min(budget.second_stage_max_tokens, remaining)
            if second_max <= 0:
                return finish([first], inserted_ids, inserted_text)
            second = Request(list(prompt_ids) + list(first.token_ids) + inserted_ids,
                             dataclasses.replace(params, max_new_tokens=second_max,
                                                 min_new_tokens=min(params.min_new_tokens, second_max)),
                             kind=kind, priority=priority, request_id=first.request_id + "/stage2")
            future = outer._submit_stage(second)
            if future is None:                     # aborted after the first stage: keep what exists
                return finish([dataclasses.replace(first, finish_reason="abort")], [], "")
            future.add_done_callback(lambda f: on_second(first, inserted_ids, inserted_text, f))
        except BaseException as exc:  # noqa: BLE001
            outer._resolve(exc=exc)

    outer._submit_stage(first_request).add_done_callback(on_first)
    return outer
