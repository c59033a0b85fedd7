"""Tests of jaxopd.tokenizer: Qwen3 ids, added tokens, round trips, chat rendering, and parity with transformers."""
from __future__ import annotations

import random
import unicodedata

import pytest

from jaxopd.tokenizer import (
    QWEN3_ADDED_TOKENS,
    QWEN3_CHAT_TEMPLATE,
    HFTokenizer,
    Qwen3Tokenizer,
    load_tokenizer,
    write_hf_tokenizer_files,
)

ALL_QWEN3_ADDED_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
    "<think>": 151667, "</think>": 151668,
}
# Hugging Face marks these 14 as special (dropped by skip_special_tokens); the other 12 are plain added tokens.
SKIPPED_BY_SKIP_SPECIAL = {t for t, i in ALL_QWEN3_ADDED_TOKENS.items() if i <= 151656}


@pytest.fixture(scope="module")
def tok() -> Qwen3Tokenizer:
    return Qwen3Tokenizer()


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> HFTokenizer:
    folder = write_hf_tokenizer_files(tmp_path_factory.mktemp("qwen3_hf_tokenizer"))
    loaded = load_tokenizer(folder)
    assert isinstance(loaded, HFTokenizer)
    return loaded


# ---------------------------------------------------------------------------------------------------------
# Deterministic varied strings
# ---------------------------------------------------------------------------------------------------------
_PIECES = [
    # ASCII words, casing, contractions, punctuation
    "Hello", "world", "the", "middle", "room", "Cabinet", "GO TO", "countertop", "don't", "I'LL", "we've",
    "they'd", "it's", "O'Reilly", "!", "?", "...", ",", ";", ":", "(", ")", "[x]", "{y}", "<>", "<|", "|>",
    "--", "==>", "#", "@user", "a_b", "x/y", "\\n", "\"quoted\"", "'single'", "`code`", "~", "$5", "50%",
    # digits and numbers
    "0", "7", "12345", "3.14159", "1,000,000", "2026-11-29", "v0.10.2", "١٢٣", "²", "½", "Ⅻ", "99999999999",
    # accents (precomposed, NFC-stable)
    "café", "naïve", "Ångström", "Škoda", "façade", "résumé", "Ελληνικά", "Привет", "Ğüşıöç",
    # CJK and other scripts
    "你好", "世界", "日本語のテキスト", "한국어", "中文标点，。！", "مرحبا", "नमस्ते", "ภาษาไทย", "עברית",
    # emoji, including modifiers, ZWJ sequences and flags
    "🙂", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🚀🚀", "⭐",
    # whitespace runs, tabs, newlines
    " ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n ", " \t\n", "\u00a0", "\u3000",
    # control and rare characters
    "\x00", "\x07", "\x7f", "\ufeff", "\u200b", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\U0001F9EA",
]
_SEPARATORS = ["", "", " ", " ", "\n", "\t", "  "]


def varied_strings(count: int = 200, seed: int = 20261129) -> list[str]:
    rng = random.Random(seed)
    strings = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 14)):
            parts.append(rng.choice(_PIECES))
            parts.append(rng.choice(_SEPARATORS))
        strings.append("".join(parts))
    return strings


VARIED = varied_strings()


# ---------------------------------------------------------------------------------------------------------
# Ids
# ---------------------------------------------------------------------------------------------------------
def test_known_ids(tok):
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.encode("Hello world! You are in the middle of a room.") == [
        9707, 1879, 0, 1446, 525, 304, 279, 6149, 315, 264, 3054, 13
    ]
    # Byte-level ranks of printable ASCII are ord(c) - 33 ('!' is rank 0); digits are split one by one.
    assert tok.encode("12345") == [ord(c) - 33 for c in "12345"] == [16, 17, 18, 19, 20]
    assert tok.encode("") == []
    assert tok.vocab_size == 151669 and tok.eos_token_id == 151645 and tok.pad_token_id == 151643


def test_pretokenizer_regex_is_qwen2s():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from jaxopd.tokenizer import QWEN2_PRETOKENIZE_REGEX

    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX


def test_digits_are_single_tokens(tok):
    for text in VARIED + ["123456789", "x = 1000000;", "٣٤٥٦"]:
        for token_id in tok.encode(text):
            piece = tok.id_to_token_bytes(token_id).decode("utf-8", errors="ignore")
            numerals = [c for c in piece if unicodedata.category(c).startswith("N")]
            assert len(numerals) <= 1, (text, piece)


def test_every_added_token_has_its_qwen3_id(tok):
    assert {token: token_id for token_id, token, _ in QWEN3_ADDED_TOKENS} == ALL_QWEN3_ADDED_TOKENS
    for token, token_id in ALL_QWEN3_ADDED_TOKENS.items():
        assert tok.encode(token) == [token_id], token
        assert tok.decode([token_id]) == token
        assert tok.token_to_id(token) == token_id
    # Recognised inside text, between ordinary tokens.
    assert tok.encode("a<think>b</think>\n\n<|im_end|>x") == [
        tok.token_to_id("a"), 151667, tok.token_to_id("b"), 151668, tok.token_to_id("\n\n"), 151645,
        tok.token_to_id("x"),
    ]
    assert tok.token_to_id(" world") == 1879 and tok.token_to_id("Hello") == 9707
    with pytest.raises(ValueError, match="not a single token"):
        tok.token_to_id("Hello world")


def test_skip_special_tokens_keeps_think_and_tool_markers(tok):
    text = "".join(ALL_QWEN3_ADDED_TOKENS) + "done"
    ids = tok.encode(text)
    assert len(ids) == 26 + 1
    expected = "".join(t for t in ALL_QWEN3_ADDED_TOKENS if t not in SKIPPED_BY_SKIP_SPECIAL) + "done"
    assert tok.decode(ids, skip_special_tokens=True) == expected
    assert tok.decode(ids) == text


def test_decode_skips_ids_without_text_like_hf(tok):
    """Ids past the vocabulary (the embedding's padding rows 151,669..151,935, which a random model samples)
    decode to "", as in Qwen's Hugging Face fast tokenizer (see the parity test below); negative ids raise."""
    hello = tok.encode("Hello world!")
    assert tok.decode([151669] + hello + [151935, 151700]) == "Hello world!"
    assert tok.decode(list(range(151669, 151936))) == ""
    assert tok.decode(hello + [151_936, 10 ** 9], skip_special_tokens=True) == "Hello world!"
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_round_trip_on_200_varied_strings(tok):
    assert len(set(VARIED)) == 200
    for text in VARIED:
        assert unicodedata.is_normalized("NFC", text)
        ids = tok.encode(text)
        assert tok.decode(ids) == text, repr(text)
    # Decoding a split multi-byte character token by token gives replacement characters, as a whole it is exact.
    ids = tok.encode("👨‍👩‍👧")
    assert tok.decode(ids) == "👨‍👩‍👧"


def test_nfc_normalisation_like_hugging_face(tok):
    decomposed, composed = "cafe\u0301 A\u030angstro\u0308m", "café Ångström"
    assert tok.encode(decomposed) == tok.encode(composed)
    assert tok.decode(tok.encode(decomposed)) == composed
    # Added tokens are cut out before normalising: '>' + U+0338 would otherwise compose into '≯'.
    assert tok.encode("<think>\u0338") == [151667] + tok.encode("\u0338")


# ---------------------------------------------------------------------------------------------------------
# Chat rendering
# ---------------------------------------------------------------------------------------------------------
THREE_TURN_CHAT = [
    {"role": "system", "content": "You are a household agent."},
    {"role": "user", "content": "Your task is to: put a mug in the sink."},
    {"role": "assistant", "content": "<think>\nThe mug is on the table.\n</think>\n\n<action>take mug 1</action>"},
    {"role": "user", "content": "You pick up the mug 1."},
]


def test_three_turn_chat_thinking(tok):
    expected = (
        "<|im_start|>system\nYou are a household agent.<|im_end|>\n"
        "<|im_start|>user\nYour task is to: put a mug in the sink.<|im_end|>\n"
        "<|im_start|>assistant\n<action>take mug 1</action><|im_end|>\n"
        "<|im_start|>user\nYou pick up the mug 1.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(THREE_TURN_CHAT, enable_thinking=True) == expected
    assert tok.apply_chat_template(THREE_TURN_CHAT, enable_thinking=True, tokenize=True) == tok.encode(expected)


def test_three_turn_chat_no_thinking(tok):
    expected = (
        "<|im_start|>system\nYou are a household agent.<|im_end|>\n"
        "<|im_start|>user\nYour task is to: put a mug in the sink.<|im_end|>\n"
        "<|im_start|>assistant\n<action>take mug 1</action><|im_end|>\n"
        "<|im_start|>user\nYou pick up the mug 1.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(THREE_TURN_CHAT, enable_thinking=False) == expected
    ids = tok.apply_chat_template(THREE_TURN_CHAT, enable_thinking=False, tokenize=True)
    assert ids[-7:] == [151644, 77091, 198, 151667, 271, 151668, 271]   # assistant=77091, "\n"=198, "\n\n"=271


def test_reasoning_kept_after_last_user_query(tok):
    # An assistant turn after the last user query keeps its reasoning (from reasoning_content or <think>).
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "\nR\n"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n"
    )
    # The last message gets an (empty) think block even without reasoning.
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    )


def test_chat_errors(tok):
    with pytest.raises(ValueError, match="role 'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="tool_calls"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}])
    with pytest.raises(ValueError, match="str 'content'"):
        tok.apply_chat_template([{"role": "user", "content": None}])


CHAT_CASES = [
    THREE_TURN_CHAT,
    THREE_TURN_CHAT[1:],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}],
    [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "plain answer"},
        {"role": "system", "content": "mid system"},
        {"role": "user", "content": "<tool_response>r</tool_response>"},
        {"role": "assistant", "content": "\n\n<think>\n\nstep\n\n</think>\n\n\nfinal"},
        {"role": "assistant", "content": "no reasoning here"},
        {"role": "assistant", "content": "x", "reasoning_content": "given"},
    ],
    [
        {"role": "user", "content": "héllo 你好 🙂"},
        {"role": "assistant", "content": "<think>a</think>b<think>c</think>d"},
        {"role": "assistant", "content": "", "reasoning_content": ""},
    ],
]


@pytest.mark.parametrize("case", range(len(CHAT_CASES)))
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_qwen3_jinja_template(tok, case, enable_thinking, add_generation_prompt):
    """Independent reference: Qwen3's jinja chat_template rendered by jinja2 (as transformers does)."""
    import jinja2

    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    template = environment.from_string(QWEN3_CHAT_TEMPLATE)
    messages = CHAT_CASES[case]
    expected = template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )
    got = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )
    assert got == expected


# ---------------------------------------------------------------------------------------------------------
# Hugging Face folder: same ids, same decoding, same chat rendering
# ---------------------------------------------------------------------------------------------------------
def test_hf_tokenizer_matches_on_200_strings(tok, hf_tok):
    assert hf_tok.vocab_size == 151669 and hf_tok.eos_token_id == 151645 and hf_tok.pad_token_id == 151643
    extra = ["cafe\u0301", "<think>\u0338", "x<|im_start|>user\nhi<|im_end|>", "".join(ALL_QWEN3_ADDED_TOKENS)]
    for text in VARIED + extra:
        ids = tok.encode(text)
        assert hf_tok.encode(text) == ids, repr(text)
        assert hf_tok.decode(ids) == tok.decode(ids), repr(text)
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    for token, token_id in ALL_QWEN3_ADDED_TOKENS.items():
        assert hf_tok.token_to_id(token) == token_id
    assert hf_tok.token_to_id(" world") == 1879
    padded = [151669] + tok.encode("Hello world!") + [151700, 151935]        # embedding padding rows
    assert hf_tok.hf_tokenizer.decode(padded) == hf_tok.decode(padded) == tok.decode(padded) == "Hello world!"


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_hf_tokenizer_chat_matches(tok, hf_tok, enable_thinking):
    for messages in CHAT_CASES:
        for add_generation_prompt in (True, False):
            kwargs = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
            assert hf_tok.apply_chat_template(messages, **kwargs) == tok.apply_chat_template(messages, **kwargs)
            assert hf_tok.apply_chat_template(messages, tokenize=True, **kwargs) == tok.apply_chat_template(
                messages, tokenize=True, **kwargs
            )


def test_load_tokenizer_choice(tmp_path):
    assert isinstance(load_tokenizer(), Qwen3Tokenizer)
    (tmp_path / "config.json").write_text("{}")           # a model folder without tokenizer files
    assert isinstance(load_tokenizer(tmp_path), Qwen3Tokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a folder"):
        load_tokenizer(tmp_path / "config.json")
