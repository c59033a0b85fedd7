"""How well a model fits demonstrations under teacher forcing: the cheap gate of an SFT teacher's grounding.

Owns ``demonstration_fit``. For turn-level demonstration samples (``jaxopd.methods.sft_data.walkthrough_samples`` of
held-out games), one dense forward pass per batch gives, at every response position, the model's next-token
distribution given the demonstration's own prefix. From it:

- ``response_nll``: the mean negative log-likelihood of a response token (nats);
- ``action_exact``: the fraction of turns where the argmax is the demonstrated token at every token of the action
  (between ``<action>`` and ``</action>``). Then greedy decoding, started after the demonstration's thinking,
  writes exactly the demonstrated action. The rule is exact for greedy decoding;
- ``goal_object_prob`` / ``goal_object_exact``: at the response's first mention of the task's goal object (ALFWorld:
  ``"mug"`` of "put a clean mug in coffeemachine", in the thinking "I need a mug." or in an action "take mug 2
  from ..."), the probability of its first token, and the fraction of mentions whose every token is the argmax.
  It measures whether the model copies the object from its instruction, which a model that only learned the
  answer format and the frequent objects does not.
- ``tool_verb_prob`` / ``tool_verb_exact`` (``tool_mentions`` turns): the same at the verb of the response's first
  tool sentence (``sft_data.tool_sentence``, "Tool: cool it with a fridge."; None without one): whether the model
  reads the change word of its instruction (2026-11: 0.49 on training turns after 300 steps, where it copies the
  tool from the verb at 0.997).

A few seconds per dozen turns on CPU, against minutes for playing episodes.

Owns ``free_running_fit`` too: the same demonstration states, but the model writes its whole answer itself (greedy,
through the paged engine under the rollouts' thinking budget), as in play. Teacher forcing hands the model the
demonstration's thinking; free-running, its own first copy can go wrong and the action follows it, which is how a
teacher can fit the demonstrations and still win nothing (2026-11). ``score_free_answers`` scores
answers against the demonstrations: the action exact (by the demonstrated verb), the thinking exact, whether the
thinking names the goal object, whether it copies the listing an arrival or an opening gave, and answers without a
parsable action.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd_envs.alfworld_state import without_restated_instruction
from jaxopd.methods.divergence import supervised_log_softmax
from jaxopd.methods.sft_data import listing_said, says_in_view, tool_said
from jaxopd.methods.transcripts import thinking_of
from jaxopd.rollout.actions import extract_action
from jaxopd.rollout.tags import ACTION_END, ACTION_START
from jaxopd.rollout.thinking import ThinkingBudget, submit_budgeted
from jaxopd.sampler.types import SamplingParams
from jaxopd.train.buffer import Sample, collate_samples

__all__ = ["demonstration_fit", "token_spans", "free_running_fit", "score_free_answers"]


@functools.partial(jax.jit, static_argnames=("graphdef", "width"))
def _response_scores(graphdef, params, tokens, positions, attention_mask, loss_mask, *, width: int):
    mask = loss_mask.astype(bool)
    order = jnp.argsort(jnp.logical_not(mask), axis=1, stable=True)[:, :width]
    logp = supervised_log_softmax(graphdef, params, tokens, positions, attention_mask, order, 1.0)
    targets = jnp.take_along_axis(tokens, order, axis=1)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return target_logp, jnp.argmax(logp, axis=-1) == targets


def token_spans(pieces: Sequence[str], start: int, end: int) -> list[int]:
    """Indices of the tokens (decoded ``pieces``, in order) whose characters overlap the text range [start, end)."""
    spans, offset = [], 0
    for index, piece in enumerate(pieces):
        if offset < end and offset + len(piece) > start:
            spans.append(index)
        offset += len(piece)
    return spans


def demonstration_fit(model: Any, samples: Sequence[Sample], tokenizer: Any, *,
                      goal_objects: Sequence[str | None] | None = None, batch_size: int = 8,
                      length_multiple: int = 128) -> dict[str, float]:
    """The teacher-forced fit of ``model`` (a ``CausalLM``) to ``samples`` (see the module docstring).

    ``goal_objects[i]``: the goal-object class of sample i's task (None: not scored). Returns ``turns``,
    ``response_tokens``, ``response_nll``, ``action_turns`` (turns whose action tags were found), ``action_exact``,
    ``action_exact_by_verb`` (per first word of the demonstrated action, ``go``, ``take``, ...: exact turns of turns),
    and with goal objects ``goal_mentions``, ``goal_object_prob`` and ``goal_object_exact`` (None without mentions).
    """
    if not samples:
        raise ValueError("demonstration_fit needs at least one sample")
    if goal_objects is not None and len(goal_objects) != len(samples):
        raise ValueError(f"{len(goal_objects)} goal objects for {len(samples)} samples")
    graphdef, params = nnx.split(model)
    width = max(s.num_supervised for s in samples)
    nll, tokens_seen, action_turns, action_hits = 0.0, 0, 0, 0
    mentions, goal_prob, goal_hits = 0, 0.0, 0
    tool_mentions, tool_prob, tool_hits = 0, 0.0, 0
    by_verb: dict[str, list[int]] = {}
    for start in range(0, len(samples), batch_size):
        chunk = list(samples[start:start + batch_size])
        batch = collate_samples(chunk, batch_size=batch_size, length_multiple=length_multiple)
        logp, hit = jax.device_get(_response_scores(
            graphdef, params, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
            jnp.asarray(batch.attention_mask), jnp.asarray(batch.loss_mask), width=width))
        for row, sample in enumerate(chunk):
            n = sample.num_supervised
            row_logp, row_hit = np.asarray(logp[row, :n], np.float64), np.asarray(hit[row, :n], bool)
            nll -= float(row_logp.sum())
            tokens_seen += n
            pieces = [tokenizer.decode([int(i)]) for i in sample.tokens[sample.loss_mask]]
            text = "".join(pieces)
            opened, closed = text.find(ACTION_START), text.find(ACTION_END)
            if 0 <= opened < closed:
                span = token_spans(pieces, opened + len(ACTION_START), closed)
                if span:
                    exact = int(row_hit[span].all())
                    verb = (text[opened + len(ACTION_START):closed].split() or [""])[0]
                    counts = by_verb.setdefault(verb, [0, 0])
                    counts[0] += exact
                    counts[1] += 1
                    action_turns += 1
                    action_hits += exact
            goal = None if goal_objects is None else goal_objects[start + row]
            match = re.search(rf"\b{re.escape(goal)}\b", text) if goal else None
            if match:
                span = token_spans(pieces, match.start(), match.end())
                mentions += 1
                goal_prob += float(np.exp(row_logp[span[0]]))
                goal_hits += int(row_hit[span].all())
            tool = tool_said(text)
            if tool:
                span = token_spans(pieces, tool.start(1), tool.end(1))
                tool_mentions += 1
                tool_prob += float(np.exp(row_logp[span[0]]))
                tool_hits += int(row_hit[span].all())
    result: dict[str, Any] = {"turns": len(samples), "response_tokens": tokens_seen,
                              "response_nll": nll / max(tokens_seen, 1), "action_turns": action_turns,
                              "action_exact": action_hits / action_turns if action_turns else None,
                              "action_exact_by_verb": {verb: {"exact": hits, "turns": turns}
                                                       for verb, (hits, turns) in sorted(by_verb.items())},
                              "tool_mentions": tool_mentions,
                              "tool_verb_prob": tool_prob / tool_mentions if tool_mentions else None,
                              "tool_verb_exact": tool_hits / tool_mentions if tool_mentions else None}
    if goal_objects is not None:
        result.update(goal_mentions=mentions, goal_object_prob=goal_prob / mentions if mentions else None,
                      goal_object_exact=goal_hits / mentions if mentions else None)
    return result


# ----------------------------------------------------------------------------------------------------------
# Free-running: the model writes the whole answer
# ----------------------------------------------------------------------------------------------------------
def _prompt_and_demonstration(sample: Sample, tokenizer: Any) -> tuple[list[int], str]:
    supervised = np.flatnonzero(sample.loss_mask)
    if not len(supervised):
        raise ValueError("a demonstration sample needs supervised (response) tokens")
    first = int(supervised[0])
    return [int(i) for i in sample.tokens[:first]], tokenizer.decode([int(i) for i in sample.tokens[first:]])


def _names(text: str | None, goal: str | None) -> bool:
    """Whether ``text`` names ``goal`` beyond a restated instruction (which names it by copying)."""
    return bool(text and goal and re.search(rf"\b{re.escape(goal)}\b", without_restated_instruction(text)))


def score_free_answers(samples: Sequence[Sample], answers: Sequence[str], tokenizer: Any, *,
                       goal_objects: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Scores of free-running ``answers[i]`` (response text) against the demonstration of ``samples[i]``.

    Returns ``turns``; ``action_exact`` (the answer's ``<action>`` equals the demonstrated one) and
    ``action_exact_by_verb`` (per first word of the demonstrated action: exact turns of turns); ``no_action`` (no
    parsable action); ``thinking_exact`` (the answer's thinking block equals the demonstration's, over the turns
    whose demonstration thinks); and with goal objects ``thinking_names_goal``: the share of answers whose thinking
    names the goal-object class (over the turns whose demonstrated thinking names it), a restated instruction not
    counted (``jaxopd_envs.alfworld_state.without_restated_instruction``); ``goal_in_view_said``: the share of the turns
    whose demonstration says the goal object is in view ("I see apple 4 here.", ``sft_data.says_in_view``) where the
    answer says so too (``goal_in_view_turns`` of them), and ``goal_in_view_claimed``: the share of the other turns
    where the answer says so all the same (the agent perceiving a goal object that is not there); ``listing_copied``:
    of the ``listing_turns`` whose demonstrated thinking copies what an arrival or an opening listed
    (``sft_data.listing_sentence``, "Here: apple, mug."), the share whose answer's thinking says that very
    sentence (whether the agent reads the observation it answers).
    """
    if len(answers) != len(samples):
        raise ValueError(f"{len(answers)} answers for {len(samples)} samples")
    if goal_objects is not None and len(goal_objects) != len(samples):
        raise ValueError(f"{len(goal_objects)} goal objects for {len(samples)} samples")
    if not samples:
        raise ValueError("score_free_answers needs at least one sample")
    exact = no_action = thinking_turns = thinking_exact = goal_turns = goal_named = 0
    in_view_turns = in_view_said = in_view_claimed = listing_turns = listing_copied = 0
    by_verb: dict[str, list[int]] = {}
    for index, (sample, answer) in enumerate(zip(samples, answers)):
        _, demonstration = _prompt_and_demonstration(sample, tokenizer)
        wanted, got = extract_action(demonstration), extract_action(answer)
        if wanted is None:
            raise ValueError(f"demonstration {index} has no <action>: {demonstration!r}")
        hit = int(got == wanted)
        exact += hit
        no_action += got is None
        counts = by_verb.setdefault(wanted.split()[0], [0, 0])
        counts[0] += hit
        counts[1] += 1
        wanted_thinking, got_thinking = thinking_of(demonstration), thinking_of(answer)
        if wanted_thinking:
            thinking_turns += 1
            thinking_exact += got_thinking == wanted_thinking
        listing = listing_said(wanted_thinking)
        if listing is not None:
            listing_turns += 1
            listing_copied += listing_said(got_thinking) == listing
        goal = None if goal_objects is None else goal_objects[index]
        if _names(wanted_thinking, goal):
            goal_turns += 1
            goal_named += _names(got_thinking, goal)
        if says_in_view(wanted_thinking, goal):
            in_view_turns += 1
            in_view_said += says_in_view(got_thinking, goal)
        else:
            in_view_claimed += says_in_view(got_thinking, goal)
    turns = len(samples)
    result: dict[str, Any] = {
        "turns": turns, "action_exact": exact / turns, "no_action": no_action / turns,
        "action_exact_by_verb": {verb: {"exact": hits, "turns": n} for verb, (hits, n) in sorted(by_verb.items())},
        "thinking_turns": thinking_turns,
        "thinking_exact": thinking_exact / thinking_turns if thinking_turns else None,
        "listing_turns": listing_turns, "listing_copied": listing_copied / listing_turns if listing_turns else None}
    if goal_objects is not None:
        result.update(goal_turns=goal_turns, thinking_names_goal=goal_named / goal_turns if goal_turns else None,
                      goal_in_view_turns=in_view_turns,
                      goal_in_view_said=in_view_said / in_view_turns if in_view_turns else None,
                      goal_in_view_claimed=(in_view_claimed / (turns - in_view_turns)
                                            if turns > in_view_turns else None))
    return result


def free_running_fit(engine: Any, samples: Sequence[Sample], tokenizer: Any, *, budget: ThinkingBudget,
                     goal_objects: Sequence[str | None] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Greedy answers of ``engine`` (a started ``jaxopd.sampler.Engine``) to the prompts of ``samples`` under the
    thinking ``budget`` (``jaxopd.rollout.thinking.submit_budgeted``, the rollouts' full-response path), scored by
    :func:`score_free_answers`. Returns the scores and the answers' texts."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    futures = [submit_budgeted(engine, tokenizer, _prompt_and_demonstration(sample, tokenizer)[0], params, budget)
               for sample in samples]
    answers = [future.result().text for future in futures]
    return score_free_answers(samples, answers, tokenizer, goal_objects=goal_objects), answers
