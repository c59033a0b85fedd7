"""Shared pytest setup: 8 simulated CPU devices, offline Hugging Face, small random Qwen3 checkpoints."""
import os

# Must happen before jax is imported anywhere: tests simulate an 8-device host for sharding.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

os.environ.pop("JAXOPD_MALLOC_TUNING", None)    # glibc's defaults in the test session and the commands it starts

try:        # alfworld's import writes $ALFWORLD_DATA; import it once here the way envs does, which undoes that, so that
    from jaxopd_envs.alfworld_import import import_alfworld     # tests' own `importorskip("alfworld")` cannot
    import_alfworld()                                           # leak the variable
except ImportError:                         # the [envs] extra is not installed: those tests skip
    pass

SMALL_HF_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def make_hf_qwen3(folder, *, tied: bool, seed: int = 0, **overrides):
    """A random tiny Qwen3 made by transformers and saved with save_pretrained (float32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**SMALL_HF_CONFIG, **overrides}, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1: perturb them so a wrong norm mapping cannot pass
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def hf_qwen3(request, tmp_path_factory):
    """(folder, torch model) of a random tiny Qwen3, tied and untied."""
    folder = tmp_path_factory.mktemp("hf_tied" if request.param else "hf_untied")
    model = make_hf_qwen3(folder, tied=request.param)
    return folder, model


def _mapped_regions() -> int | None:
    """The memory mappings of this process (Linux), or None where /proc is not there."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """After each test file, drop JAX's caches of compiled programs. XLA:CPU maps every compiled program's code and
    data as a dozen anonymous memory regions that live as long as the program is cached; one pytest process that
    compiles through every file holds tens of thousands of them, reaches Linux's vm.max_map_count (65,530), and
    then segfaults inside the next XLA compile when LLVM's mmap fails (measured: 3,152 regions at 7 % of the
    default run, rising with each file). Tests that share compiled programs do so within a file."""
    yield
    import sys
    if "jax" in sys.modules:
        import gc

        import jax
        jax.clear_caches()
        gc.collect()
    regions = _mapped_regions()
    if regions is not None:
        _PEAK_REGIONS[0] = max(_PEAK_REGIONS[0], regions)


_PEAK_REGIONS = [0]


def pytest_terminal_summary(terminalreporter):
    if _PEAK_REGIONS[0]:
        terminalreporter.write_line(f"memory mappings after a test file, at most: {_PEAK_REGIONS[0]:,} "
                                    "(Linux's default vm.max_map_count: 65,530)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavier tests (run in CI; deselect with -m 'not slow')")


# llama.cpp's pre-tokenizer 'smollm' (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM): two regexes applied in turn,
# the first isolating every Unicode number code point, the second GPT-2's
_SMOLLM_REGEXES = (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")


def llama_cpp_smollm_ids(text: str, hf_tokenizer, specials: dict[str, int]) -> list[int]:
    """Token ids of ``text`` as llama.cpp tokenizes a GGUF whose tokenizer.ggml.pre is 'smollm': special tokens
    matched whole, the two regexes of llama.cpp (each splits the pieces the previous one left; text between
    matches is kept as its own piece), then byte-level BPE of each piece by ``hf_tokenizer``'s BPE model (the
    same vocabulary and merges). An independent reference for the pre-tokenizer of an imported tokenizer."""
    import regex
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    bpe = hf_tokenizer.backend_tokenizer.model
    ids: list[int] = []
    parts = regex.split("(" + "|".join(regex.escape(s) for s in specials) + ")", text) if specials else [text]
    for part in parts:
        if part in specials:
            ids.append(specials[part])
            continue
        pieces = [part] if part else []
        for pattern in _SMOLLM_REGEXES:
            split = []
            for piece in pieces:
                at = 0
                for m in regex.finditer(pattern, piece):
                    if m.start() > at:
                        split.append(piece[at:m.start()])
                    split.append(m.group())
                    at = m.end()
                if at < len(piece):
                    split.append(piece[at:])
            pieces = split
        for piece in pieces:
            ids.extend(t.id for t in bpe.tokenize("".join(byte_chars[b] for b in piece.encode("utf-8"))))
    return ids
