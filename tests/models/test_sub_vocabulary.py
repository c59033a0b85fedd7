"""A model over a sub-vocabulary of Qwen3's ids: the tokenizer's map and byte fallback, the cut-down model's logits
against the full model's (ours and transformers'), its folder round trip, the engine's end-of-turn ids, and an SFT
run that cuts its model down (``--sub-vocabulary``), resumes and exports."""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from tests.methods import test_sft_run
from flax import nnx

from jaxopd.models.decoder import CausalLM, dense_causal_attend
from jaxopd.models.weights import load_model, restrict_vocabulary, save_model
from jaxopd.tokenizer import (QWEN3_ADDED_TOKENS, TOKEN_MAP_KEY, Qwen3Tokenizer, SubVocabularyTokenizer,
                              byte_token_ids, load_tokenizer, sub_vocabulary)

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

source = test_sft_run.source
TEXT = ("You arrive at countertop 1. On the countertop 1, you see a mug 2, and a apple 1.\n"
        "<think>I see mug 2 here.</think><action>take mug 2 from countertop 1</action><|im_end|>")
MICRO = dataclasses.replace(test_sft_run.MICRO, num_layers=2)


@pytest.fixture(scope="module")
def qwen():
    return Qwen3Tokenizer()


def test_sub_vocabulary_holds_the_ids_the_bytes_and_the_added_tokens(qwen):
    ids = qwen.encode("go to fridge 1")
    token_map = sub_vocabulary(ids + ids[:1])
    assert token_map == tuple(sorted(token_map)) and len(set(token_map)) == len(token_map)
    assert set(ids) | set(byte_token_ids()) | {t for t, _, _ in QWEN3_ADDED_TOKENS} == set(token_map)
    assert len(byte_token_ids()) == 256
    assert [qwen.id_to_token_bytes(i) for i in byte_token_ids()] == [bytes([b]) for b in range(256)]
    with pytest.raises(ValueError, match="outside the Qwen3 vocabulary"):
        sub_vocabulary([200_000])


def test_tokenizer_numbers_mapped_tokens_in_map_order_and_spells_the_rest_in_bytes(qwen):
    token_map = sub_vocabulary(qwen.encode(TEXT))
    tokenizer = SubVocabularyTokenizer(token_map)
    assert tokenizer.vocab_size == len(token_map)
    # text of mapped tokens: Qwen3's segmentation, each id renumbered
    assert tokenizer.encode(TEXT) == [token_map.index(i) for i in qwen.encode(TEXT)]
    assert tokenizer.to_qwen_ids(tokenizer.encode(TEXT)) == qwen.encode(TEXT)
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    # words the map lacks fall back to their bytes (multi-byte characters too) and decode back unchanged
    other = "a zebra 🦓 near the xylophone, é"
    ids = tokenizer.encode(other)
    assert tokenizer.decode(ids) == other
    assert len(ids) > len(qwen.encode(other))
    assert b"".join(qwen.id_to_token_bytes(i) for i in tokenizer.to_qwen_ids(ids)) == other.encode("utf-8")
    # special tokens keep their meaning under their new ids
    assert tokenizer.eos_token_id == token_map.index(151645)
    assert tokenizer.pad_token_id == token_map.index(151643)
    assert tokenizer.token_to_id("<think>") == token_map.index(151667)
    assert tokenizer.decode([tokenizer.eos_token_id, 0], skip_special_tokens=True) == qwen.decode([token_map[0]])
    assert tokenizer.decode([len(token_map), len(token_map) + 5]) == ""
    with pytest.raises(ValueError, match="negative"):
        tokenizer.decode([-1])
    messages = [{"role": "system", "content": "Act."}, {"role": "user", "content": "go to fridge 1"}]
    assert tokenizer.apply_chat_template(messages) == qwen.apply_chat_template(messages)
    rendered = qwen.apply_chat_template(messages)
    assert tokenizer.apply_chat_template(messages, tokenize=True) == tokenizer.encode(rendered)
    with pytest.raises(ValueError, match="outside this model's"):
        SubVocabularyTokenizer(sub_vocabulary([])).token_to_id(" the")


def test_a_token_map_without_the_byte_or_added_tokens_is_refused(qwen):
    with pytest.raises(ValueError, match="lacks 282 of the single-byte and added tokens"):
        SubVocabularyTokenizer(sorted(set(qwen.encode(TEXT)) - set(byte_token_ids()) - {151645, 151667, 151668}))
    with pytest.raises(ValueError, match="repeats"):
        SubVocabularyTokenizer([*sub_vocabulary([]), 0])


@pytest.mark.parametrize("tied", [True, False])
def test_the_cut_down_model_gives_the_full_models_logits_at_the_mapped_ids(qwen, tmp_path, tied):
    full = CausalLM(dataclasses.replace(MICRO, tie_word_embeddings=tied), rngs=nnx.Rngs(3))
    token_map = sub_vocabulary(qwen.encode(TEXT))
    small = restrict_vocabulary(full, token_map)
    assert small.config.vocab_size == len(token_map) and small.config.token_map == token_map
    tokenizer = SubVocabularyTokenizer(token_map)
    ids = tokenizer.encode(TEXT)

    def logits(model, tokens):
        tokens = jnp.asarray([tokens])
        positions = jnp.arange(tokens.shape[1])[None]
        hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, jnp.ones_like(tokens, bool)))
        return np.asarray(model.logits(hidden))[0]

    expected = logits(full, qwen.encode(TEXT))[:, list(token_map)]
    np.testing.assert_allclose(logits(small, ids), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already over a sub-vocabulary"):
        restrict_vocabulary(small, token_map)
    with pytest.raises(ValueError, match="must lie in"):
        restrict_vocabulary(full, [0, MICRO.vocab_size])
    # the folder keeps the map (config.json), and every loader finds it
    folder = save_model(small, tmp_path / "small")
    config = json.loads((folder / "config.json").read_text())
    assert config[TOKEN_MAP_KEY] == list(token_map) and config["vocab_size"] == len(token_map)
    assert config["eos_token_id"] == token_map.index(151645)
    loaded = load_model(folder)
    assert loaded.config.token_map == token_map
    np.testing.assert_allclose(logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(load_tokenizer(folder), SubVocabularyTokenizer)
    assert load_tokenizer(folder).encode(TEXT) == ids
    # transformers loads it as a Qwen3 of that vocabulary and computes the same logits
    torch = pytest.importorskip("torch")
    from transformers import Qwen3ForCausalLM
    reference = Qwen3ForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(theirs, expected, rtol=1e-4, atol=1e-4)


def test_the_engine_stops_on_the_mapped_end_of_turn_ids(qwen):
    from jaxopd.sampler.engine import Engine, EngineConfig
    from jaxopd.sampler.types import Request, SamplingParams

    token_map = sub_vocabulary(qwen.encode(TEXT))
    small = restrict_vocabulary(CausalLM(MICRO, rngs=nnx.Rngs(1)), token_map)
    config = EngineConfig(max_slots=2, page_size=8, num_pages=32, max_seq_len=128, prefill_chunk=64,
                          max_prefill_tokens=128, max_prefill_rows=2)
    tokenizer = SubVocabularyTokenizer(token_map)
    prompt = tokenizer.encode("go to fridge 1")
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    with Engine(small, config, tokenizer=tokenizer) as engine:
        assert engine.config.eos_token_ids == (token_map.index(151645), token_map.index(151643))
        free = engine.generate([Request(prompt_ids=prompt, params=greedy)])[0]
    assert len(free.token_ids) == 6 and all(0 <= t < len(token_map) for t in free.token_ids)
    assert free.text == tokenizer.decode(free.token_ids)
    # end-of-turn ids are given in Qwen3's numbering: the greedy first token's Qwen3 id stops the request there
    first = free.token_ids[0]
    with Engine(small, dataclasses.replace(config, eos_token_ids=(token_map[first],)), tokenizer=tokenizer) as engine:
        stopped = engine.generate([Request(prompt_ids=prompt, params=greedy)])[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_sft_cuts_the_model_down_to_its_corpus_resumes_and_exports(source, tmp_path):
    from jaxopd.methods.metrics_log import read_jsonl

    full_out, out = tmp_path / "full", tmp_path / "sub"
    full_out.mkdir()
    out.mkdir()
    test_sft_run.sft(source, full_out, 1)
    test_sft_run.sft(source, out, 2, sub_vocabulary=True)
    second = test_sft_run.sft(source, out, 3, sub_vocabulary=True, export=str(tmp_path / "hf"))
    full = [r for r in read_jsonl(full_out / "train.jsonl") if r["kind"] == "train"]
    sub = [r for r in read_jsonl(out / "train.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in sub] == [1, 2, 3]
    # step 1, the same weights and batch: the context term's softmax is over the corpus's ids either way, so it is
    # the same; the response's softmax over the sub-vocabulary instead of all 151,669 ids gives a lower NLL
    assert sub[0]["context_nll"] == pytest.approx(full[0]["context_nll"], rel=1e-5)
    assert sub[0]["nll"] < full[0]["nll"]
    assert sub[2]["loss"] < sub[0]["loss"]
    exported = load_model(second["export"])
    tokenizer = load_tokenizer(second["export"])
    assert isinstance(tokenizer, SubVocabularyTokenizer)
    assert exported.config.vocab_size == tokenizer.vocab_size < 2_000
    assert exported.config.token_map == tokenizer.token_map
    # a distillation run needs the same map on both sides: another map of the same size is refused
    kept = set(exported.config.token_map)
    other = sorted(kept - {max(kept - set(byte_token_ids()) - {t for t, _, _ in QWEN3_ADDED_TOKENS})}
                   | {min(set(range(1000, 2000)) - kept)})
    teacher = restrict_vocabulary(CausalLM(MICRO, rngs=nnx.Rngs(0)), other)
    assert teacher.config.vocab_size == exported.config.vocab_size
    from jaxopd.methods.config import build_config
    from jaxopd.methods.loop import Trainer
    with pytest.raises(ValueError, match="token maps"):
        Trainer(build_config("vanilla-opd", preset="cpu"), student=exported, teacher=teacher, tokenizer=tokenizer,
                source=source, out_dir=tmp_path / "opd", progress=False)


@pytest.mark.parametrize("method", ["vanilla-opd", pytest.param("actfirst", marks=pytest.mark.slow)])
def test_distillation_between_sub_vocabulary_models_trains_and_syncs(method, source, qwen, tmp_path):
    import test_train_loop as loop

    from jaxopd.methods.config import build_config
    from jaxopd.methods.loop import Trainer
    from jaxopd.methods.metrics_log import read_jsonl
    from jaxopd.sampler.types import Request, SamplingParams

    answer = qwen.encode("<think>\nI see a mug.\n</think>\n\n<action>go to countertop 1</action>")
    token_map = sub_vocabulary([i for prompt in loop.game_prompts(source, qwen) for i in prompt] + answer)
    tokenizer = SubVocabularyTokenizer(token_map)
    probe_ids = tokenizer.encode("<|im_start|>user\nHello<|im_end|>")

    def probe(engine, update):
        result = engine.submit(Request(probe_ids, SamplingParams(max_new_tokens=4, temperature=0.0))).result(120)
        return {"probe_logprobs": [float(x) for x in result.logprobs], "served_version": engine.policy_version}

    config = build_config(method, preset="cpu", **{**loop.SMALL, "updates": 2})
    trainer = Trainer(config, student=restrict_vocabulary(CausalLM(loop.MICRO, rngs=nnx.Rngs(0)), token_map),
                      teacher=restrict_vocabulary(CausalLM(loop.MICRO, rngs=nnx.Rngs(1)), token_map),
                      tokenizer=tokenizer,
                      source=source, out_dir=tmp_path / method, progress=False, evaluate=probe,
                      log=lambda message: None)
    assert trainer.run()["updates"] == 2
    records = read_jsonl(tmp_path / method / "train.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["sampled_reverse_kl"]) for r in records)
    evals = read_jsonl(tmp_path / method / "eval.jsonl")
    assert [e["served_version"] for e in evals] == [0, 2]
    assert evals[0]["probe_logprobs"] != evals[1]["probe_logprobs"]
