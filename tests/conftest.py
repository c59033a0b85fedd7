"""Shared pytest setup: 8 simulated CPU devices, offline Hugging Face, the micro models' fixtures (shapes and
makers in ``tests/micro_models.py``)."""
import os

# Must happen before jax is imported anywhere: tests simulate an 8-device host for sharding.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

os.environ.pop("JAXOPD_MALLOC_TUNING", None)    # glibc's defaults in the test session and the commands it starts
# no persistent compilation cache either (test_compile_cache has its own), unless JAXOPD_TESTS_COMPILE_CACHE names a
# folder: CI's slow run shares one among its pytest processes and the commands its tests start (a killed and resumed
# run, the processes of a multi-process run, a chain's stages), which compile the same programs again and again
os.environ["JAXOPD_COMPILE_CACHE"] = os.environ.get("JAXOPD_TESTS_COMPILE_CACHE") or "off"

try:        # alfworld's import writes $ALFWORLD_DATA; import it once here the way envs does, which undoes that, so that
    from jaxopd_envs.alfworld_import import import_alfworld     # tests' own `importorskip("alfworld")` cannot
    import_alfworld()                                           # leak the variable
except ImportError:                         # the [envs] extra is not installed: those tests skip
    pass

from micro_models import SMALL_HF_CONFIG, make_hf_qwen3  # noqa: E402,F401  (tests import them from conftest too)


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def hf_qwen3(request, tmp_path_factory):
    """(folder, torch model) of a random tiny Qwen3, tied and untied."""
    folder = tmp_path_factory.mktemp("hf_tied" if request.param else "hf_untied")
    model = make_hf_qwen3(folder, tied=request.param)
    return folder, model


@pytest.fixture(scope="module")
def model(request):
    """The test file's random micro model, shared by its tests: ``CausalLM(CFG, rngs=nnx.Rngs(MODEL_SEED))`` of the
    file's module-level ``CFG`` (a ``micro_models.micro_config``) and ``MODEL_SEED``."""
    from flax import nnx

    from jaxopd.models.decoder import CausalLM
    return CausalLM(request.module.CFG, rngs=nnx.Rngs(request.module.MODEL_SEED))


@pytest.fixture(scope="session")
def micro_checkpoints(tmp_path_factory):
    """(student, teacher) Hugging Face folders of random micro Qwen3s (``micro_models.MICRO``, seeds 0 and 1) over
    the Qwen3 tokenizer's ids. Read-only: a test that writes into a model folder makes its own."""
    from micro_models import save_micro_pair
    return save_micro_pair(tmp_path_factory.mktemp("micro_checkpoints"))


@pytest.fixture(scope="session")
def mismatched_checkpoints(tmp_path_factory):
    """(student, teacher) folders of micro Qwen3s whose vocabularies differ: 300 and 400 ids (read-only)."""
    from micro_models import save_micro_pair
    return save_micro_pair(tmp_path_factory.mktemp("mismatched_checkpoints"), student_vocab=300, teacher_vocab=400)


@pytest.fixture(scope="session")
def alfworld_games(tmp_path_factory):
    """The root of a generated ALFWorld tree of 2 train games (seed 0), read-only; skips without alfworld."""
    pytest.importorskip("alfworld")
    from jaxopd_envs import alfworld_gen
    return alfworld_gen.ensure_games(tmp_path_factory.mktemp("alfworld_games"), seed=0,
                                     counts={"train": 2, "valid_seen": 0, "valid_unseen": 0}, workers=1,
                                     progress=False)


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


def pytest_sessionfinish(session):
    """A pytest-xdist worker (``-n``; each worker frees its own files' programs) hands its peak to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["peak_regions"] = _PEAK_REGIONS[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: the largest peak of its workers, for the summary line."""
    _PEAK_REGIONS[0] = max(_PEAK_REGIONS[0], getattr(node, "workeroutput", {}).get("peak_regions", 0))


def pytest_terminal_summary(terminalreporter):
    if _PEAK_REGIONS[0]:
        terminalreporter.write_line(f"memory mappings after a test file, at most: {_PEAK_REGIONS[0]:,} "
                                    "(Linux's default vm.max_map_count: 65,530)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavier tests (run in CI; deselect with -m 'not slow')")
    from jaxopd.compile_cache import enable_compile_cache
    enable_compile_cache()      # the test processes use the shared cache too (nothing when it is off)


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
