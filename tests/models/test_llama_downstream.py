"""The Llama family downstream of the model: everything that serves, scores, trains, shards, syncs and prompts a
``CausalLM`` takes a Llama (no q/k norms, its own tokenizer and end-of-turn id) as it takes a Qwen3.

Micro random Llama configs (6 query / 2 key-value heads: SmolLM2's odd grouping of 3) over a micro Llama-style
tokenizer made here, offline: a byte-level BPE trained on the project's own prompt text with SmolLM2's layout of
special tokens (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2) and SmolLM2's ChatML chat template, which
has no thinking switch. No Qwen3 id appears anywhere, so a hard-coded Qwen3 id would show. Checked: the engine
against a dense recompute, teacher scoring against dense log-probs, an OPD train step and SFT steps (with a resume),
the sharding rules, weight sync into a serving engine, two updates of the OPD training loop, the rollout prompts and
the model folder's tokenizer. The last test renders the prompts through the fetched SmolLM2-135M-Instruct tokenizer
(``-m pretrained``; skipped when it is not fetched).
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fake_envs import CorridorEnv, corridor_task
from jaxopd.models.decoder import CausalLM, ModelConfig, abstract_model
from jaxopd.rollout.prompts import GENERATION_MODES, PromptInputs, render_prompt, uses_thinking
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")        # ids 0, 1, 2 as in SmolLM2's tokenizer
SMOLLM2_TEMPLATE = (    # SmolLM2-135M-Instruct's chat_template (its default system text shortened)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MAX_SEQ = 512


def llama_config(vocab_size: int, **overrides) -> ModelConfig:
    return ModelConfig(**{**dict(hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                                 intermediate_size=64, vocab_size=vocab_size, rope_theta=10_000.0, rms_norm_eps=1e-5,
                                 tie_word_embeddings=True, max_position_embeddings=2048, model_type="llama",
                                 qk_norm=False, bos_token_id=1, eos_token_id=2, dtype="float32",
                                 param_dtype="float32"), **overrides})


def corridor_inputs(reference_next_observation: str | None = "You walk to spot 2.") -> PromptInputs:
    return PromptInputs(benchmark="alfworld", instruction="Your task is to: open the door.",
                        history=[("You are at the start of a corridor.", "go forward")],
                        observation="You walk to spot 1.", admissible_actions=CorridorEnv()._admissible(),
                        reference_next_observation=reference_next_observation)


# ----------------------------------------------------------------------------------------------- fixtures
def make_llama_tokenizer_folder(folder) -> None:
    """A byte-level BPE of 512 ids trained on the project's prompts, saved as a Hugging Face tokenizer folder with
    SmolLM2's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxopd.rollout.prompts import prompt_messages

    corpus = [message["content"] for mode in GENERATION_MODES
              for message in prompt_messages(mode, corridor_inputs(), 1)]
    corpus += ["<think>\nI should go forward.\n</think>\n\n<action>go forward</action>", "take key", "open door"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus * 3, trainers.BpeTrainer(vocab_size=512, special_tokens=list(SPECIALS),
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>", pad_token="<|im_end|>",
                            chat_template=SMOLLM2_TEMPLATE).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from jaxopd.tokenizer import HFTokenizer, load_tokenizer

    folder = tmp_path_factory.mktemp("llama_tokenizer")
    make_llama_tokenizer_folder(folder)
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def cfg(tokenizer):
    return llama_config(tokenizer.vocab_size)


@pytest.fixture(scope="module")
def model(cfg):
    return CausalLM(cfg, rngs=nnx.Rngs(0))


_FORWARDS: dict = {}


def dense_forward(model):
    """``run(ids) -> [len(ids), V]`` float32 logits of ``model`` without any cache (one compiled width per
    architecture: models of one graph share the compilation)."""
    graphdef, state = nnx.split(model)
    forward = _FORWARDS.get(graphdef)
    if forward is None:
        forward = _FORWARDS[graphdef] = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])

    def run(ids):
        buf = np.zeros((1, MAX_SEQ), np.int32)
        buf[0, :len(ids)] = ids
        return np.asarray(forward(state, jnp.asarray(buf)))[:len(ids)]
    return run


def dense_log_probs(logits_of, prompt, completion, temperature=1.0):
    logits = logits_of(list(prompt) + list(completion))
    logp = jax.nn.log_softmax(logits[len(prompt) - 1:-1] / temperature, axis=-1)
    return np.asarray(logp)[np.arange(len(completion)), completion]


def chat_prompts(tokenizer, *, max_prompt_tokens=400):
    return [render_prompt(tokenizer, mode, corridor_inputs(), max_prompt_tokens).token_ids for mode in GENERATION_MODES]


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    config = EngineConfig(max_slots=8, page_size=16, num_pages=256, max_seq_len=MAX_SEQ, prefill_chunk=128,
                          max_prefill_tokens=512, scoring=True)
    with Engine(model, config, tokenizer=tokenizer) as eng:
        yield eng


# ----------------------------------------------------------------------------------------------- the model
def test_micro_llama_has_no_qk_norm_and_ends_turns_at_its_own_eos(model, cfg, tokenizer):
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert not any("q_norm" in p or "k_norm" in p for p in paths)
    assert not hasattr(model.layers[0].attn, "q_norm")
    assert cfg.end_token_ids == (2,) == (tokenizer.eos_token_id,)
    assert tokenizer.token_to_id("<|im_start|>") == 1 and tokenizer.token_to_id("<|endoftext|>") == 0
    assert max(max(p) for p in chat_prompts(tokenizer)) < cfg.vocab_size <= 512


# ----------------------------------------------------------------------------------------------- engine, scoring
def test_engine_serves_a_llama_as_the_dense_recompute(model, engine, tokenizer):
    assert engine.config.eos_token_ids == (2,)           # the model's end of turn, no Qwen3 id
    rng = np.random.default_rng(0)
    prompts = chat_prompts(tokenizer) + [rng.integers(0, model.config.vocab_size, n).tolist() for n in (1, 17, 130)]
    requests = [Request(p, SamplingParams(max_new_tokens=12, temperature=0.0 if i % 2 == 0 else 0.8, seed=i))
                for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    logits_of = dense_forward(model)
    for request, result in zip(requests, results):
        assert 1 <= len(result.token_ids) <= 12
        if result.finish_reason == "stop":
            assert result.token_ids[-1] == 2
        temperature = request.params.temperature or 1.0
        want = dense_log_probs(logits_of, request.prompt_ids, result.token_ids, temperature)
        np.testing.assert_allclose(result.logprobs, want, atol=1e-4, rtol=0)
        if request.params.temperature == 0:              # greedy: each token is the dense argmax of its prefix
            n = len(request.prompt_ids)
            logits = logits_of(list(request.prompt_ids) + result.token_ids)
            assert result.token_ids == np.argmax(logits[n - 1:-1], axis=-1).tolist()
    text = engine.generate([Request(prompts[1], SamplingParams(max_new_tokens=8, stop_strings=("</action>",)))])[0]
    assert text.token_ids                                # stop strings detokenize with the Llama tokenizer


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_scoring_of_a_llama_equals_dense_log_probs(model, engine, tokenizer, temperature):
    from jaxopd.rollout.scoring import DenseTeacherScorer, EngineTeacherScorer

    logits_of = dense_forward(model)
    dense = DenseTeacherScorer(model, temperature=temperature, length_multiple=64)
    served = EngineTeacherScorer(engine, temperature=temperature, timeout=120)
    rng = np.random.default_rng(1)
    response = tokenizer.encode("<think>\nI should go forward.\n</think>\n\n<action>go forward</action>") + [2]
    for prompt, completion in [(chat_prompts(tokenizer)[0], response), (chat_prompts(tokenizer)[1], response[-6:]),
                               (rng.integers(0, model.config.vocab_size, 40).tolist(),
                                rng.integers(0, model.config.vocab_size, 25).tolist())]:
        want = dense_log_probs(logits_of, prompt, completion, temperature)
        np.testing.assert_allclose(dense.score(prompt, completion), want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(served.score(prompt, completion), want, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------- sharding, sync
def mesh_of(data, model_axis):
    from jax.sharding import AxisType, Mesh

    devices = np.asarray(jax.devices()[:data * model_axis], dtype=object).reshape(data, model_axis)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sharding_rules_give_every_llama_parameter_a_spec(cfg, tied):
    from jax.sharding import PartitionSpec as P

    from jaxopd.models.sharding import (MODEL_LOGICAL_AXES, ShardingRules, loader_sharding, partition_specs,
                                        shard_model)

    config = dataclasses.replace(cfg, tie_word_embeddings=tied, vocab_size=512)
    state = nnx.state(abstract_model(config), nnx.Param)
    mesh = mesh_of(4, 2)
    flat = dict(nnx.to_flat_state(state))
    assert {axis for var in flat.values() for axis in var.get_metadata()["axes"]} <= set(MODEL_LOGICAL_AXES)
    for rules in (ShardingRules.fsdp(), ShardingRules.fsdp_tensor()):
        specs = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(partition_specs(state, rules,
                                                                                                    mesh))}
        assert len(specs) == len(flat) and all(isinstance(s, P) for s in specs.values())
    layer = {k.split("/", 2)[2]: v for k, v in specs.items() if k.startswith("layers/1/")}
    assert layer == {                                    # fsdp_tensor: 6 query and 2 KV heads split over 2
        "attn/q_weight_dnh": P("data", "model"), "attn/k_weight_dkh": P("data", "model"),
        "attn/v_weight_dkh": P("data", "model"), "attn/o_weight_nhd": P("model", None, "data"),
        "mlp/gate_weight_df": P("data", "model"), "mlp/up_weight_df": P("data", "model"),
        "mlp/down_weight_fd": P("model", "data"), "input_norm/scale": P("data"),
        "post_attention_norm/scale": P("data")}
    assert specs["embedding_vd"] == P("model", "data")
    assert ("lm_head_dv" in specs) == (not tied) and specs.get("lm_head_dv", P("data", "model")) == P("data", "model")
    sharding = loader_sharding(state, mesh)
    for path, var in flat.items():
        assert sharding(path, var.get_value().shape).mesh == mesh
    placed = shard_model(CausalLM(config, rngs=nnx.Rngs(3)), mesh)
    assert placed.embedding_vd.get_value().sharding.spec == P("model", "data")


def test_weight_sync_into_an_engine_serving_a_llama(model, engine, tokenizer):
    from jaxopd.models.sharding import named_shardings
    from jaxopd.train import RolePlan, WeightSync, build_meshes

    meshes = build_meshes(RolePlan.disjoint(4, 2, 2, trainer_tensor_parallel=2))
    _, params = nnx.split(model, nnx.Param)
    shardings = named_shardings(params, meshes.trainer)
    update = jax.jit(lambda p: jax.tree.map(lambda x: 1.5 * x + 0.01, p), in_shardings=(shardings,),
                     out_shardings=shardings)
    trained = update(jax.device_put(params, shardings))       # a trainer-side change
    rollout = WeightSync.for_mesh(trained, meshes.rollout)(trained, version=1)
    for got in jax.tree.leaves(rollout.params):
        assert got.sharding.device_set == meshes.devices_of("rollout")
    prompt = chat_prompts(tokenizer)[1]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    version = engine.policy_version
    before = engine.generate([Request(prompt, greedy)])[0]
    engine.update_weights(rollout.params, version=version + 1)
    try:
        after = engine.generate([Request(prompt, greedy)])[0]
        assert engine.policy_version == version + 1
    finally:                                             # the module's engine serves ``model`` again
        engine.update_weights(nnx.state(model, nnx.Param), version=version + 2)
    assert after.logprobs.tolist() != before.logprobs.tolist()
    new_model = nnx.merge(nnx.split(model, nnx.Param)[0], jax.device_get(trained))
    want = dense_log_probs(dense_forward(new_model), prompt, after.token_ids)
    np.testing.assert_allclose(after.logprobs, want, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------- training
def test_opd_train_step_changes_a_llama_student(cfg, tokenizer):
    from jaxopd.models.sharding import copy_to, named_shardings
    from jaxopd.train import RolePlan, build_meshes
    from jaxopd.train.buffer import Sample, collate_samples
    from jaxopd.train.scoring import make_teacher_scorer, score_batch
    from jaxopd.train.state import (OptimizerConfig, batch_shardings, init_train_state, make_optimizer,
                                    train_state_shardings)
    from jaxopd.train.step import LossConfig, make_train_step

    student = CausalLM(cfg, rngs=nnx.Rngs(0))
    teacher = CausalLM(dataclasses.replace(cfg, tie_word_embeddings=False), rngs=nnx.Rngs(1))
    meshes = build_meshes(RolePlan.for_device_count(len(jax.devices())))
    rng = np.random.default_rng(2)
    samples = []
    for prompt in chat_prompts(tokenizer, max_prompt_tokens=320) + chat_prompts(tokenizer, max_prompt_tokens=320)[:1]:
        response = rng.integers(3, cfg.vocab_size, 12).tolist() + [2]
        tokens = np.asarray(prompt + response, np.int32)
        mask = np.arange(len(tokens)) >= len(prompt)
        samples.append(Sample(tokens, mask, np.where(mask, -5.0, 0.0).astype(np.float32), 0))
    batch = collate_samples(samples, length_multiple=64)
    loss_config = LossConfig(kind="opd")
    graphdef, params = nnx.split(student, nnx.Param)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    state_shardings = train_state_shardings(params, optimizer, meshes.trainer)
    rows = batch_shardings(meshes.trainer)
    step = make_train_step(graphdef, optimizer, loss_config, state_shardings, rows)
    state = init_train_state(params, optimizer, state_shardings)
    teacher_graphdef, teacher_state = nnx.split(teacher, nnx.Param)
    teacher_shardings = named_shardings(teacher_state, meshes.teacher)
    scorer = make_teacher_scorer(teacher_graphdef, teacher_shardings, meshes.teacher)
    scored = score_batch(scorer, copy_to(teacher_state, teacher_shardings), batch, rows)
    want = DenseScore(teacher)(samples)
    got = np.asarray(scored.teacher_logp)
    for i, sample in enumerate(samples):
        np.testing.assert_allclose(got[i, 1:len(sample.tokens)][sample.loss_mask[1:]], want[i], atol=1e-5)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, scored)
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before, state.params))
    assert all(changed)


class DenseScore:
    """The teacher's log-probs of each sample's response tokens, one unpadded sequence at a time."""

    def __init__(self, model):
        from jaxopd.rollout.scoring import DenseTeacherScorer
        self.scorer = DenseTeacherScorer(model, length_multiple=64)

    def __call__(self, samples):
        out = []
        for sample in samples:
            start = int(np.argmax(sample.loss_mask))
            out.append(self.scorer.score(sample.tokens[:start].tolist(), sample.tokens[start:].tolist()))
        return out


def test_sft_steps_train_and_resume_a_llama(cfg, tokenizer, tmp_path):
    from jaxopd_envs.references import build_reference
    from jaxopd.methods.sft import train_sft
    from jaxopd.methods.sft_data import walkthrough_samples

    reference = build_reference(CorridorEnv(), corridor_task(0))
    samples, stats = walkthrough_samples([reference], tokenizer, max_prompt_tokens=400)
    fast, _ = walkthrough_samples([reference], tokenizer, max_prompt_tokens=400, mode="next_action")
    assert stats.samples == 5 and len(fast) == 5
    for sample in samples + fast:
        assert sample.tokens[-1] == 2 and sample.tokens[0] == 1      # <|im_start|> ... <|im_end|>
    start = int(np.argmax(fast[0].loss_mask))
    assert tokenizer.decode(fast[0].tokens[:start]).endswith("<|im_start|>assistant\n")
    assert "<think>" not in tokenizer.decode(fast[0].tokens[:start])
    assert tokenizer.decode(fast[0].tokens[start:]) == "<action>go forward</action><|im_end|>"

    model = CausalLM(cfg, rngs=nnx.Rngs(4))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    common = dict(batch_size=2, learning_rate=1e-2, max_train_tokens=MAX_SEQ, max_supervised_tokens=64,
                  progress=False, tensorboard=False, log=lambda message: None)
    first = train_sft(model, samples + fast, tmp_path, steps=1, **common)
    after = jax.tree.map(np.asarray, nnx.state(first, nnx.Param))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after)))
    resumed = train_sft(CausalLM(cfg, rngs=nnx.Rngs(4)), samples + fast, tmp_path, steps=2, **common)
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    assert resumed.config.model_type == "llama"


def test_opd_loop_runs_two_updates_with_a_llama_student_and_teacher(cfg, tokenizer, tmp_path):
    from jaxopd.methods.benchmarks import BenchmarkSource
    from jaxopd.methods.config import build_config
    from jaxopd.methods.loop import Trainer
    from jaxopd.methods.metrics_log import read_jsonl

    config = build_config("vanilla-opd", preset="cpu", updates=2, batch_size=2, rollout_slots=2, collection_tasks=2,
                          max_turns=2, max_prompt_tokens=448, max_train_tokens=512, first_stage_tokens=8,
                          total_tokens=16, second_stage_tokens=4, fast_action_tokens=6, checkpoint_every=2,
                          learning_rate=1e-2, page_size=64)
    probe_ids = chat_prompts(tokenizer)[1]

    def probe(engine, update):
        result = engine.submit(Request(probe_ids, SamplingParams(max_new_tokens=4, temperature=0.0))).result(120)
        return {"probe_logprobs": [float(x) for x in result.logprobs], "served_version": engine.policy_version}

    source = BenchmarkSource("alfworld", None, "generated", CorridorEnv)
    trainer = Trainer(config, student=CausalLM(cfg, rngs=nnx.Rngs(0)),
                      teacher=CausalLM(dataclasses.replace(cfg, tie_word_embeddings=False), rngs=nnx.Rngs(1)),
                      tokenizer=tokenizer, source=source, out_dir=tmp_path, progress=False, evaluate=probe,
                      tasks=[corridor_task(i) for i in range(3)], tensorboard=False, log=lambda message: None)
    summary = trainer.run()
    assert summary["updates"] == 2
    records = read_jsonl(tmp_path / "train.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["served_version"] for e in evals] == [0, 2]
    assert evals[0]["probe_logprobs"] != evals[1]["probe_logprobs"]          # the trained weights reached the engine


# ----------------------------------------------------------------------------------------------- prompts, folders
def check_chatml_prompts(tokenizer, texts_and_ids, *, system: str) -> None:
    """Every mode's prompt: a system turn, a user turn, the open assistant turn, in ChatML, and nothing else."""
    for mode, (text, ids) in texts_and_ids.items():
        assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nTask: "), mode
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n"), mode
        assert text.count("<|im_start|>") == 3 and text.count("<|im_end|>") == 2, mode
        assert "<think>" not in text and "</think>" not in text, mode          # no Qwen3 thinking block
        assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3 and ids.count(tokenizer.eos_token_id) == 2
        assert ids[-3:] == tokenizer.encode("<|im_start|>assistant\n")[-3:]
        assert tokenizer.decode(ids) == text


def test_rollout_prompts_through_a_template_without_thinking_switch(tokenizer):
    from jaxopd.rollout.prompts import _SYSTEM_PROMPTS

    assert not tokenizer.thinking_switch
    assert uses_thinking("full") and not uses_thinking("next_action")
    rendered = {mode: render_prompt(tokenizer, mode, corridor_inputs(), 400) for mode in GENERATION_MODES}
    check_chatml_prompts(tokenizer, {m: (r.text, r.token_ids) for m, r in rendered.items()},
                         system=_SYSTEM_PROMPTS["alfworld"])
    assert "Target next observation" in rendered["inverse_dynamics"].text
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, enable_thinking=False) == tokenizer.apply_chat_template(messages)


def test_a_llama_folder_carries_its_tokenizer(cfg, tokenizer, tmp_path):
    from jaxopd.models.weights import load_model, save_model
    from jaxopd.tokenizer import TokenizerError, check_tokenizer_files, load_tokenizer, save_tokenizer

    save_model(CausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path)
    with pytest.raises(TokenizerError, match="llama model without tokenizer files"):
        load_tokenizer(tmp_path)                         # never the offline Qwen3 tokenizer for a Llama
    with pytest.raises(TokenizerError):
        check_tokenizer_files(tmp_path)                  # the commands' input check, before any model is built
    assert save_tokenizer(tokenizer, tmp_path)
    check_tokenizer_files(tmp_path)
    again = load_tokenizer(tmp_path)
    text = render_prompt(tokenizer, "next_action", corridor_inputs(), 400).text
    assert again.encode(text) == tokenizer.encode(text) and again.eos_token_id == 2 and not again.thinking_switch
    loaded = load_model(tmp_path)
    assert loaded.config.model_type == "llama" and loaded.config.end_token_ids == (2,)


def test_random_weights_need_a_preset_the_offline_tokenizer_fits():
    from jaxopd import cli

    assert cli.check_random_preset("--model", "tiny") == "tiny"
    with pytest.raises(cli.UsageError, match="smollm2-135m.*model's Hugging Face folder"):
        cli.check_random_preset("--model", "smollm2-135m")
    with pytest.raises(cli.UsageError, match="not a model preset"):
        cli.check_random_preset("--model", "laptop")


@pytest.mark.pretrained
def test_rollout_prompts_render_through_smollm2s_tokenizer():
    from jaxopd.models.pretrained import is_fetched, pretrained_dir
    from jaxopd.rollout.prompts import _SYSTEM_PROMPTS
    from jaxopd.tokenizer import HFTokenizer, load_tokenizer

    folder = pretrained_dir("smollm2-135m-instruct")
    if not is_fetched(folder):
        pytest.skip(f"SmolLM2-135M-Instruct is not fetched into {folder} (python -m experiments.fetch_model "
                    "smollm2-135m-instruct)")
    tok = load_tokenizer(folder)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert isinstance(tok, HFTokenizer) and not tok.thinking_switch
    assert (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_start|>"), tok.eos_token_id) == (0, 1, 2)
    assert config.model_type == "llama" and config.end_token_ids == (tok.eos_token_id,)
    for benchmark, inputs in [("alfworld", corridor_inputs()),
                              ("scienceworld", PromptInputs(benchmark="scienceworld", instruction="Boil water.",
                                                            history=[("You are in the kitchen.", "look around")],
                                                            observation="You see a stove.",
                                                            action_templates=("look around", "activate OBJ"),
                                                            objects=("stove", "water"),
                                                            reference_next_observation="The stove is on."))]:
        rendered = {mode: render_prompt(tok, mode, inputs, 2048) for mode in GENERATION_MODES}
        check_chatml_prompts(tok, {m: (r.text, r.token_ids) for m, r in rendered.items()},
                             system=_SYSTEM_PROMPTS[benchmark])
        for r in rendered.values():
            assert max(r.token_ids) < config.vocab_size and r.history_pairs_kept == 1
            assert "SmolLM" not in r.text                 # our system turn, not the template's default one
        assert rendered["full"].text != rendered["next_action"].text
