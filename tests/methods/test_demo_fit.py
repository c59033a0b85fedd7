"""jaxopd.methods.demo_fit: teacher-forced fit figures against a dense recompute of the same model."""
import numpy as np
import pytest
from flax import nnx

from jaxopd.methods.demo_fit import demonstration_fit, free_running_fit, score_free_answers, token_spans
from jaxopd.methods.sft_data import response_text
from jaxopd.models.decoder import CausalLM, ModelConfig
from jaxopd.tokenizer import load_tokenizer
from jaxopd.train.buffer import Sample

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)


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
    config = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=64, vocab_size=151_936, tie_word_embeddings=True,
                         dtype="float32", param_dtype="float32")
    model = CausalLM(config, rngs=nnx.Rngs(3))
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


def test_tool_verb_matches_a_dense_recompute(setup):
    """``tool_verb_prob`` / ``tool_verb_exact``: at the verb of the first "Tool: V it with a T." of a response, the
    probability of its first token and whether every token is the argmax, by a dense forward pass; turns without the
    sentence are not counted, and a response without any gives None."""
    tokenizer, model, samples = setup
    assert demonstration_fit(model, samples, tokenizer)["tool_verb_prob"] is None
    tool_samples, probs, hits = [], [], []
    for prompt, thinking in (("Task: cool some apple.", "Task: cool some apple. Tool: cool it with a fridge."),
                             ("Task: put a hot egg in fridge.",
                              "Tool: heat it with a microwave. Tool: cool it with a x."),
                             ("Task: find a pen.", "I need a pen.")):
        ids = tokenizer.encode(prompt)
        response = tokenizer.encode(response_text("go to fridge 1", thinking)) + [tokenizer.eos_token_id]
        tokens = np.array(ids + response)
        mask = np.array([False] * len(ids) + [True] * len(response))
        tool_samples.append(Sample(tokens=tokens, loss_mask=mask, behavior_logp=np.zeros(len(tokens), np.float32),
                                   policy_version=0))
        logits = np.asarray(model(tokens[None]))[0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        positions = np.flatnonzero(mask)
        pieces = [tokenizer.decode([int(t)]) for t in tokens[positions]]
        text = "".join(pieces)
        if "Tool: " not in text:
            continue
        at = text.index("Tool: ") + len("Tool: ")
        span = token_spans(pieces, at, text.index(" it with", at))
        probs.append(np.exp(logp[positions[span[0]] - 1, tokens[positions[span[0]]]]))
        hits.append(all(logp[positions[i] - 1].argmax() == tokens[positions[i]] for i in span))
    fit = demonstration_fit(model, tool_samples, tokenizer, batch_size=2)
    assert fit["tool_mentions"] == len(probs) == 2
    np.testing.assert_allclose(fit["tool_verb_prob"], np.mean(probs), rtol=1e-3)
    assert fit["tool_verb_exact"] == np.mean(hits)


def test_a_goal_absent_from_the_response_is_not_a_mention(setup):
    tokenizer, model, samples = setup
    fit = demonstration_fit(model, samples, tokenizer, goal_objects=["mug", None, "bowl"])
    assert fit["goal_mentions"] == 1
    assert "goal_mentions" not in demonstration_fit(model, samples, tokenizer)
    with pytest.raises(ValueError, match="2 goal objects for 3 samples"):
        demonstration_fit(model, samples, tokenizer, goal_objects=["mug", "x"])


def test_free_answers_scored_by_hand(setup):
    tokenizer, _, samples = setup
    goals = ["mug", "apple", "pen"]
    answers = [
        "<think>\nI need a mug.\n</think>\n\n<action>go to countertop 1</action>",      # all as demonstrated
        "<think>\nI need a book.\n</think>\n\n<action>go to fridge 1</action>",         # right action, wrong thinking
        "<think>\nI need a pen.\n</think>\n\n<action>take pen 3</action>",              # a wrong action
    ]
    scores = score_free_answers(samples, answers, tokenizer, goal_objects=goals)
    assert scores["turns"] == 3 and scores["action_exact"] == pytest.approx(2 / 3) and scores["no_action"] == 0
    assert scores["action_exact_by_verb"] == {"go": {"exact": 2, "turns": 2}, "take": {"exact": 0, "turns": 1}}
    # the third demonstration has no thinking: two thinking turns, the first exact; the goal named in 1 of 2
    assert scores["thinking_turns"] == 2 and scores["thinking_exact"] == 0.5
    assert scores["goal_turns"] == 2 and scores["thinking_names_goal"] == 0.5
    unparsable = score_free_answers(samples, ["<think>\nI need a mug.", "go to fridge 1", ""], tokenizer)
    assert unparsable["no_action"] == 1.0 and unparsable["action_exact"] == 0.0 and "goal_turns" not in unparsable
    with pytest.raises(ValueError, match="2 answers for 3 samples"):
        score_free_answers(samples, answers[:2], tokenizer)


def _demonstrated_samples(tokenizer, prompt: str, demonstrated) -> list[Sample]:
    """One sample per (thinking, action): ``prompt``'s tokens, then the response, supervised."""
    samples = []
    for thinking, action in demonstrated:
        ids = tokenizer.encode(prompt)
        response = tokenizer.encode(response_text(action, thinking)) + [tokenizer.eos_token_id]
        samples.append(Sample(tokens=np.array(ids + response), loss_mask=np.array([False] * len(ids) + [True] *
                                                                                 len(response)),
                              behavior_logp=np.zeros(len(ids) + len(response), np.float32), policy_version=0))
    return samples


def test_goal_in_view_said_and_claimed_by_hand(setup):
    """``goal_in_view_said``: of the demonstrations saying "I see <goal> N here.", the answers saying it too (any
    number); ``goal_in_view_claimed``: of the others, the answers saying it anyway. Another object in view (a lamp)
    is not the goal."""
    from jaxopd.methods.sft_data import in_view_sentence, says_in_view

    tokenizer = setup[0]
    demonstrated = [("I need a mug. " + in_view_sentence("mug 2"), "take mug 2 from shelf 1"),
                    ("I need a mug. " + in_view_sentence("mug 1"), "take mug 1 from desk 1"),
                    ("I need a mug. I am at desk 1.", "go to shelf 1"),
                    ("I need a mug. I am at bed 1.", "go to desk 1"),
                    ("I hold mug 1. I need a desklamp. I see desklamp 1 here.", "use desklamp 1")]
    samples = _demonstrated_samples(tokenizer, "Task: look at mug under the desklamp.", demonstrated)
    answers = ["<think>\nI need a mug. I see mug 7 here.\n</think>\n\n<action>take mug 7 from shelf 1</action>",
               "<think>\nI need a mug. I am at desk 1.\n</think>\n\n<action>go to bed 1</action>",
               "<think>\nI need a mug. I see mug 3 here.\n</think>\n\n<action>take mug 3 from desk 1</action>",
               "<think>\nI need a mug. I see cup 1 here.\n</think>\n\n<action>go to desk 1</action>",
               "<think>\nI hold mug 1. I see mug 1 here.\n</think>\n\n<action>use desklamp 1</action>"]
    scores = score_free_answers(samples, answers, tokenizer, goal_objects=["mug"] * 5)
    assert scores["goal_in_view_turns"] == 2 and scores["goal_in_view_said"] == 0.5
    assert scores["goal_in_view_claimed"] == pytest.approx(2 / 3)      # answers 3 and 5; "cup 1" is not a mug
    assert says_in_view("I see mug 12 here.", "mug") and not says_in_view("I see mug here.", "mug")
    assert not says_in_view("I see mugwort 1 here.", "mug") and not says_in_view(None, "mug")


def test_free_running_answers_are_the_dense_greedy_decode(setup):
    from jaxopd.rollout.thinking import ThinkingBudget
    from jaxopd.sampler import Engine, EngineConfig

    tokenizer, model, samples = setup
    budget = ThinkingBudget(first_stage_tokens=6, total_tokens=6)
    config = EngineConfig(max_slots=2, page_size=16, num_pages=2 * 4 + 1, max_seq_len=64, prefill_chunk=64,
                          max_prefill_tokens=128, max_prefill_rows=2)
    with Engine(model, config, tokenizer=tokenizer) as engine:
        scores, answers = free_running_fit(engine, samples, tokenizer, budget=budget, goal_objects=["mug", None, "x"])
    assert scores["turns"] == 3 and scores["action_exact"] == 0.0 and scores["no_action"] == 1.0
    for sample, answer in zip(samples, answers):
        ids = list(sample.tokens[:np.flatnonzero(sample.loss_mask)[0]])
        for _ in range(budget.first_stage_tokens):            # greedy by dense recompute of the whole sequence
            ids.append(int(np.asarray(model(np.array([ids])))[0, -1].argmax()))
        greedy = tokenizer.decode(ids[-budget.first_stage_tokens:])
        assert answer.startswith(greedy), (answer, greedy)   # then the budget's early-stop text, when it fits


def test_cli_teacher_adds_the_exact_reverse_kl_of_each_model(tmp_path, monkeypatch):
    """``experiments.demo_fit --teacher``: each model's row carries its exact reverse KL to the teacher on the same
    demonstration turns — zero for the teacher itself, ``exact_reverse_kl``'s value for another model."""
    import functools
    import json

    from tests.methods import test_train_loop

    from jaxopd_envs import alfworld_gen
    from jaxopd_experiments import demo_fit as cli
    from jaxopd.methods import benchmarks
    from jaxopd.methods.divergence import exact_reverse_kl
    from jaxopd.methods.sft_data import walkthrough_samples
    from jaxopd.models.weights import load_model, save_model

    pytest.importorskip("alfworld")
    from jaxopd_envs.alfworld import AlfWorldEnv

    root = alfworld_gen.ensure_games(tmp_path / "games", seed=0, counts={"train": 2, "valid_seen": 0,
                                                                         "valid_unseen": 0}, workers=1, progress=False)
    source = benchmarks.BenchmarkSource("alfworld", root, "generated", functools.partial(AlfWorldEnv, root))
    monkeypatch.setattr(benchmarks, "resolve_source", lambda *args, **kwargs: source)
    folders = []
    for seed in (0, 1):
        folders.append(str(save_model(CausalLM(test_train_loop.MICRO, rngs=nnx.Rngs(seed)), tmp_path / f"m{seed}")))
    out = tmp_path / "fit.json"
    assert cli.main(["--model", folders[0], "--model", folders[1], "--teacher", folders[1], "--split", "train",
                     "--num-tasks", "2", "--demonstrations", "walkthrough", "--thinking", "state",
                     "--kl-temperature", "0.7", "--top-k", "4", "64", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["teacher"] == folders[1] and result["kl_temperature"] == 0.7
    tokenizer = load_tokenizer(None)
    tasks = benchmarks.subset(source.tasks("train"), 2, seed=0)
    references = benchmarks.references_for(source, tasks, workers=1, progress=False, kind="solution")
    samples, _ = walkthrough_samples(references, tokenizer, max_prompt_tokens=1024, thinking="state")
    expected = exact_reverse_kl(nnx.split(load_model(folders[0]), nnx.Param),
                                nnx.split(load_model(folders[1]), nnx.Param), samples, temperature=0.7)
    assert result["models"][folders[0]]["exact_reverse_kl"] == pytest.approx(expected, rel=1e-5)
    assert expected > 1e-3
    assert result["models"][folders[1]]["exact_reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert "exact reverse KL" in out.with_suffix(".md").read_text()
    # --top-k: the share of that KL the opd-exact loss's top-K form keeps, and its gradient's cosine
    top = result["models"][folders[0]]["top_k"]
    assert 0 < top["4"]["kl_fraction"] < top["64"]["kl_fraction"] < 1 and 0 < top["4"]["gradient_cosine"] < 1
    assert top["4"]["exact_reverse_kl"] == pytest.approx(expected, rel=1e-4)
    assert result["models"][folders[1]]["top_k"]["4"]["kl_fraction"] is None     # the teacher itself: no KL
    assert "top-K form" in out.with_suffix(".md").read_text()


def test_listing_copied_by_hand(setup):
    """``listing_copied``: of the demonstrations whose thinking copies a listing ("Here: apple, mug."), the answers
    whose thinking says that very sentence; a listing in a turn whose demonstration lists nothing is not counted,
    and another listing, a partial one or none at all is a miss."""
    from jaxopd.methods.sft_data import listing_said, listing_sentence

    tokenizer = setup[0]
    here = listing_sentence(["apple", "mug"])
    demonstrated = [(f"I need a mug. {here} I see mug 2 here.", "take mug 2 from shelf 1"),
                    (f"I need a mug. {here}", "go to desk 1"),
                    (f"I need a mug. {listing_sentence([])}", "go to desk 1"),
                    (f"I need a mug. {here}", "go to bed 1"),
                    ("I need a mug. I am at desk 1.", "go to shelf 1")]
    samples = _demonstrated_samples(tokenizer, "Task: put a mug in desk.", demonstrated)
    answers = ["<think>\nI need a mug. Here: apple, mug. I see mug 7 here.\n</think>\n\n<action>go to bed 1</action>",
               "<think>\nI need a mug. Here: mug.\n</think>\n\n<action>go to desk 1</action>",
               "<think>\nI need a mug. Here: nothing.\n</think>\n\n<action>go to desk 1</action>",
               "<think>\nI need a mug.\n</think>\n\n<action>go to bed 1</action>",
               "<think>\nI need a mug. Here: pen.\n</think>\n\n<action>go to shelf 1</action>"]
    scores = score_free_answers(samples, answers, tokenizer)
    assert scores["listing_turns"] == 4 and scores["listing_copied"] == 0.5         # answers 1 and 3
    assert listing_said("Tool: x. Here: apple, cup. I see") == "Here: apple, cup."
    assert listing_said("Here: nothing.") == "Here: nothing." and listing_said("I am here.") is None
    assert listing_said(None) is None
