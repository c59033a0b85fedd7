"""jaxopd.methods.demo_fit: teacher-forced fit figures against a dense recompute of the same model."""
import numpy as np
import pytest
from flax import nnx

from jaxopd.methods.demo_fit import demonstration_fit, token_spans
from jaxopd.methods.sft_data import response_text
from jaxopd.models.qwen3 import Qwen3, Qwen3Config
from jaxopd.tokenizer import load_tokenizer
from jaxopd.train.buffer import Sample


def test_token_spans_cover_the_characters():
    pieces = ["<", "action", ">", "take", " mug", " ", "2", "</", "action", ">"]
    text = "".join(pieces)
    start, end = text.index(">") + 1, text.index("</")
    assert token_spans(pieces, start, end) == [3, 4, 5, 6]
    assert token_spans(pieces, text.index("mug"), text.index("mug") + 3) == [4]
    assert token_spans(pieces, 0, 0) == []


@pytest.fixture(scope="module")
def setup():
    tokenizer = load_tokenizer(None)
    config = Qwen3Config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=64, vocab_size=151_936, tie_word_embeddings=True,
                         dtype="float32", param_dtype="float32")
    model = Qwen3(config, rngs=nnx.Rngs(3))
    samples = []
    for prompt, thinking, action in (("Task: put a mug in cabinet.", "I need a mug.", "go to countertop 1"),
                                     ("Task: cool some apple.", "I hold apple 1, now cool.", "go to fridge 1"),
                                     ("Task: find a pen.", "", "take pen 3 from desk 1")):
        ids = tokenizer.encode(prompt)
        response = tokenizer.encode(response_text(action, thinking)) + [tokenizer.eos_token_id]
        tokens = np.array(ids + response)
        mask = np.array([False] * len(ids) + [True] * len(response))
        samples.append(Sample(tokens=tokens, loss_mask=mask, behavior_logp=np.zeros(len(tokens), np.float32),
                              policy_version=0))
    return tokenizer, model, samples


def dense_expectation(model, tokenizer, samples, goals):
    nll, count, action_hits, probs, goal_hits = 0.0, 0, [], [], []
    for sample, goal in zip(samples, goals):
        logits = np.asarray(model(sample.tokens[None]))[0].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        positions = np.flatnonzero(sample.loss_mask)
        target = sample.tokens[positions]
        token_logp = logp[positions - 1, target]
        argmax_ok = logp[positions - 1].argmax(-1) == target
        nll -= token_logp.sum()
        count += len(positions)
        pieces = [tokenizer.decode([int(t)]) for t in target]
        text = "".join(pieces)
        span = token_spans(pieces, text.index("<action>") + 8, text.index("</action>"))
        action_hits.append(argmax_ok[span].all())
        if goal in text:
            at = text.index(goal)
            span = token_spans(pieces, at, at + len(goal))
            probs.append(np.exp(token_logp[span[0]]))
            goal_hits.append(argmax_ok[span].all())
    by_verb = {}
    for sample, hit in zip(samples, action_hits):
        text = tokenizer.decode(list(sample.tokens[sample.loss_mask]))
        verb = text[text.index("<action>") + 8:].split()[0]
        by_verb.setdefault(verb, {"exact": 0, "turns": 0})
        by_verb[verb]["exact"] += int(hit)
        by_verb[verb]["turns"] += 1
    return nll / count, np.mean(action_hits), np.mean(probs), np.mean(goal_hits), len(probs), by_verb


def test_fit_matches_a_dense_recompute(setup):
    tokenizer, model, samples = setup
    goals = ["mug", "apple", "pen"]
    fit = demonstration_fit(model, samples, tokenizer, goal_objects=goals, batch_size=2)
    nll, action, prob, goal_exact, mentions, by_verb = dense_expectation(model, tokenizer, samples, goals)
    assert fit["turns"] == 3 and fit["action_turns"] == 3 and fit["goal_mentions"] == mentions == 3
    assert fit["response_tokens"] == sum(s.num_supervised for s in samples)
    np.testing.assert_allclose(fit["response_nll"], nll, rtol=1e-4)
    np.testing.assert_allclose(fit["goal_object_prob"], prob, rtol=1e-3)
    assert fit["action_exact"] == action and fit["goal_object_exact"] == goal_exact
    assert fit["action_exact_by_verb"] == by_verb and by_verb["go"]["turns"] == 2 and by_verb["take"]["turns"] == 1
    # a random model is near-uniform over 151,936 ids: nothing is copied
    assert fit["response_nll"] > 11.0 and fit["goal_object_prob"] < 1e-4


def test_a_goal_absent_from_the_response_is_not_a_mention(setup):
    tokenizer, model, samples = setup
    fit = demonstration_fit(model, samples, tokenizer, goal_objects=["mug", None, "bowl"])
    assert fit["goal_mentions"] == 1
    assert "goal_mentions" not in demonstration_fit(model, samples, tokenizer)
    with pytest.raises(ValueError, match="2 goal objects for 3 samples"):
        demonstration_fit(model, samples, tokenizer, goal_objects=["mug", "x"])
