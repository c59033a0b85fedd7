"""The micro models of the tests in one place: four named shapes of a random float32 Qwen3 and ``micro_config`` to
make a ``ModelConfig`` of one; random tiny Qwen3 and Llama checkpoints made by transformers (the independent
reference of the weight port), and the two helpers every comparison against them uses. ``tests/conftest.py`` turns
the common uses into fixtures.

A test whose assertion needs a particular shape (a Llama's GQA ratios, a vocabulary that GGUF's quantised blocks
tile, a layer count it cuts) writes that config where it uses it. Imports are lazy: conftest imports this file
before any test, and jax, torch and transformers load only when a model is made.
"""
# one layer, 2 query heads over 1 KV head of 8: the smallest; the training loop, the command lines, rollouts
MICRO = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32)
# one layer, 2 query heads over 1 KV head of 16: the engine's protocol, defects, overlap and fuzz
SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
# two layers, 4 query heads over 2 KV heads of 16: layers scanned or unrolled, mixed steps, page layouts, kernels
TWO_LAYER = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64)
# two layers, 64 wide: the sampler against a dense recompute, prefix sharing, teacher scoring, bfloat16
MEDIUM = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)

# the transformers Qwen3 of the weight-port tests (HF field names)
SMALL_HF_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def micro_config(shape: dict, vocab_size: int | None = None, **fields):
    """A float32 ModelConfig of ``shape`` (one of the dicts above) over ``vocab_size`` ids; by default the Qwen3
    tokenizer's 151,669 (no padding rows, which a random model would sample and the tokenizer cannot decode)."""
    from jaxopd.models.decoder import ModelConfig
    from jaxopd.tokenizer import QWEN3_VOCAB_SIZE

    vocab_size = QWEN3_VOCAB_SIZE if vocab_size is None else vocab_size
    return ModelConfig(**{**shape, "vocab_size": vocab_size, "dtype": "float32", "param_dtype": "float32", **fields})


def save_micro_pair(folder, student_vocab: int | None = None, teacher_vocab: int | None = None, shape: dict = MICRO):
    """Random student (seed 0) and teacher (seed 1) of ``shape`` saved as Hugging Face folders ``folder/student``
    and ``folder/teacher`` (vocabularies as in ``micro_config``); returns the two paths."""
    from pathlib import Path

    from flax import nnx

    from jaxopd.models.decoder import CausalLM
    from jaxopd.models.weights import save_model

    folder = Path(folder)
    for name, vocab, seed in (("student", student_vocab, 0), ("teacher", teacher_vocab, 1)):
        save_model(CausalLM(micro_config(shape, vocab), rngs=nnx.Rngs(seed)), folder / name)
    return folder / "student", folder / "teacher"


def perturb_norms(model):
    """Adds noise to a transformers model's norm weights (HF initialises them to 1, so a wrong norm mapping would
    pass); returns the model."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_hf_qwen3(folder, *, tied: bool, seed: int = 0, **overrides):
    """A random tiny Qwen3 made by transformers and saved with save_pretrained (float32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**SMALL_HF_CONFIG, **overrides}, tie_word_embeddings=tied)
    model = perturb_norms(Qwen3ForCausalLM(cfg).eval())
    model.save_pretrained(folder)
    return model


def torch_logits(model, ids):
    """A transformers model's float32 logits [len(ids), vocab] for one unpadded sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_padded_logits_match(model, torch_model, prompts, padding_side: str, atol: float = 1e-4):
    """Our ``model``'s float32 logits of ``prompts`` batched with padding on the ``padding_side`` ("right" or
    "left"; id 0, masked) equal the transformers model's of each prompt alone at the unpadded positions."""
    import jax.numpy as jnp
    import numpy as np

    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(tokens, dtype=bool)
    positions = np.zeros_like(tokens)
    for b, ids in enumerate(prompts):
        start = 0 if padding_side == "right" else width - len(ids)
        tokens[b, start:start + len(ids)] = ids
        mask[b, start:start + len(ids)] = True
        positions[b, start:start + len(ids)] = np.arange(len(ids))
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    assert logits.dtype == np.float32
    for b, ids in enumerate(prompts):
        ref = torch_logits(torch_model, ids)
        np.testing.assert_allclose(logits[b][mask[b]], ref, atol=atol, rtol=0)
        assert np.abs(ref).max() > 0.1  # the comparison is not between near-zero tensors
