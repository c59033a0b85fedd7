"""bf16 by default on accelerators (issue 12 item 3): a bf16 engine (weights and KV cache in bf16, logits
and log-probs in float32) against the float32 engine on the same random tiny model: the same greedy tokens
on most steps, with the log-prob error reported."""
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd.models.decoder import CausalLM, ModelConfig, default_dtype
from micro_models import MEDIUM, micro_config
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

VOCAB = 512
CFG = micro_config(MEDIUM, vocab_size=VOCAB)
ENGINE = EngineConfig(max_slots=8, page_size=8, num_pages=256, max_seq_len=160, prefill_chunk=32,
                      max_prefill_tokens=128, eos_token_ids=())


def test_dtype_policy():
    expected = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    assert default_dtype() == expected and ModelConfig.preset("qwen3-0.6b").dtype == expected
    assert ModelConfig.preset("qwen3-0.6b", dtype="bfloat16").param_dtype == "bfloat16"


def test_bf16_engine_against_float32():
    f32_model = CausalLM(CFG, rngs=nnx.Rngs(2))
    bf16_model = CausalLM(CFG.with_dtypes("bfloat16"), rngs=nnx.Rngs(2))     # the same weights, rounded
    rng = np.random.default_rng(0)
    # free-running greedy decoding; the log-prob error is measured on each request's common token prefix
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 40, 64)]
    params = SamplingParams(max_new_tokens=24, min_new_tokens=24, temperature=0.0)
    runs = {}
    for name, model in (("float32", f32_model), ("bfloat16", bf16_model)):
        with Engine(model, ENGINE) as engine:
            leaves = jax.tree.leaves(engine.executor.kv)
            assert all(leaf.dtype == jnp.dtype(name) for leaf in leaves)    # KV cache in the model dtype
            results = [engine.submit(Request(p, params)).result(120) for p in prompts]
            runs[name] = results
    same = total = 0
    worst = 0.0
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        assert a.logprobs.dtype == np.float32 and b.logprobs.dtype == np.float32
        agree = 0
        for x, y in zip(a.token_ids, b.token_ids):     # steps agree until the first divergence
            if x != y:
                break
            agree += 1
        same += sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        total += len(a.token_ids)
        if agree:
            worst = max(worst, float(np.max(np.abs(a.logprobs[:agree] - b.logprobs[:agree]))))
    agreement = same / total
    print(f"\nbf16 vs float32: {agreement:.1%} identical greedy tokens over {total} steps; "
          f"max |dlogprob| on the common prefix {worst:.3e}")
    assert agreement >= 0.9
    assert worst < 0.1
