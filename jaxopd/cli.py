"""Bad input on the command lines: one line naming the problem on stderr, exit code 2, no traceback.

Owns, for every command line of the project (``experiments/*.py``, ``bench/*.py``):

* ``Parser``: the ``argparse`` parser whose usage errors (an unknown flag, a wrong choice such as a preset name,
  a number that does not parse) are the one line ``error: ... (see python -m X --help)`` and exit code 2, with no
  usage dump;
* ``UsageError``: bad input found by a command's own checks;
* ``run_main``: runs a command's body and turns a ``UsageError`` into ``error: ...`` on stderr and exit code 2
  (``usage_errors`` turns the ``ValueError`` of a configuration check, before any work starts, into one);
* the shared checks, each raising ``UsageError`` with the message every command uses: a checkpoint folder
  (``check_checkpoint_folder``), an input folder (``check_input_folder``), an output folder or file
  (``check_out_dir``, ``check_out_file``), ``$ALFWORLD_DATA`` (``check_alfworld_data``), a model architecture
  preset (``check_model_preset``; one to run with random weights: ``check_random_preset``) and the teacher's
  vocabulary against the student's (``check_same_vocabulary``, ``checkpoint_vocab_size``).

Nothing heavy is imported here (no jax): a bad flag is rejected before the slow imports of a command.
``check_model_preset`` and ``check_random_preset`` alone import ``jaxopd.models.decoder`` (and so jax), when called.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ALFWORLD_DATA_ENV = "ALFWORLD_DATA"
EXIT_USAGE = 2

__all__ = ["EXIT_USAGE", "Parser", "UsageError", "usage_errors", "report", "run_main", "check_input_folder",
           "check_checkpoint_folder", "check_out_dir", "check_out_file", "check_alfworld_data", "check_model_preset",
           "check_random_preset", "checkpoint_vocab_size", "check_same_vocabulary"]


class UsageError(ValueError):
    """Bad input: reported as one line and exit code 2. A ``ValueError``, so the checks of a command that already
    catches ``ValueError`` report it unchanged."""


class Parser(argparse.ArgumentParser):
    """Usage errors are one line naming the problem and exit code 2 (no usage dump). Give ``prog`` as the command
    is typed (``python -m experiments.train``): it is named in the hint."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text: Any) -> str:
    return " ".join(str(text).splitlines()).strip()


def report(error: BaseException | str) -> int:
    """Print ``error: <message>`` as one line on stderr; returns the exit code 2."""
    print(f"error: {_one_line(error)}", file=sys.stderr, flush=True)
    return EXIT_USAGE


@contextlib.contextmanager
def usage_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """Inside the block, an exception of ``kinds`` (default ``ValueError``: a configuration check that refused the
    input, before any work started) becomes a ``UsageError`` with its message. Wrap checks only, never the run:
    a ``ValueError`` of the work itself is a bug and keeps its traceback."""
    caught: tuple[type[BaseException], ...] = kinds or (ValueError,)
    try:
        yield
    except UsageError:
        raise
    except caught as error:
        raise UsageError(str(error)) from None


def command_line(prog: str, argv: Sequence[str] | None = None) -> str:
    """The command as a user would retype it, for a result's record: ``prog`` (``python -m experiments.x``) and
    ``argv`` (default: this process's arguments), shell-quoted."""
    import shlex
    return f"{prog} {shlex.join(sys.argv[1:] if argv is None else list(argv))}".rstrip()


def run_main(body: Callable[[], Any]) -> int:
    """``body()``'s exit code when it returns an int, else 0 (None, or a result a benchmark's ``main`` returns);
    a ``UsageError`` from it is one line on stderr and exit code 2.

        def main(argv=None) -> int:
            args = build_parser().parse_args(argv)
            return cli.run_main(lambda: run(args))

    First, when ``JAXOPD_MALLOC_TUNING=1`` is set, it keeps the host allocator's freed memory
    (``jaxopd.host_malloc.tune_malloc``: XLA on CPU otherwise faults each step's working set in again), and it turns
    on JAX's persistent compilation cache (``jaxopd.compile_cache``; ``JAXOPD_COMPILE_CACHE=off`` leaves it off).
    """
    from jaxopd.compile_cache import enable_compile_cache
    from jaxopd.host_malloc import tune_malloc

    tune_malloc()
    enable_compile_cache()
    try:
        code = body()
    except UsageError as error:
        return report(error)
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


# ------------------------------------------------------------------------------------------------ the checks
def check_input_folder(flag: str, path: str | os.PathLike) -> Path:
    """``path`` (given as ``flag``) is an existing folder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UsageError(f"{flag} {str(path)!r}: no such folder")
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is not a folder")
    return folder


def check_checkpoint_folder(flag: str, path: str | os.PathLike) -> Path:
    """``path`` (given as ``flag``) is a Hugging Face checkpoint folder: it exists and holds ``config.json``."""
    folder = check_input_folder(flag, path)
    if not (folder / "config.json").is_file():
        raise UsageError(f"{flag} {str(path)!r} is not a Hugging Face checkpoint (no config.json)")
    return folder


def check_out_dir(flag: str, path: str | os.PathLike, *, create: bool = True) -> Path:
    """``path`` (given as ``flag``) is a folder that can be created and written: created now, a probe file written
    and removed, so that a run fails here rather than when it writes its results. ``create=False`` creates
    nothing: the probe is written in the nearest folder that exists (a command that checks more input later
    creates its folders only once everything passed)."""
    out = Path(path).expanduser()
    if create:
        _check_writable_folder(flag, path, out)
        return out
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a file; a folder is needed")
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is not writable: {str(ancestor)!r} is a file, not a folder")
    _check_writable_folder(flag, path, ancestor)
    return out


def check_out_file(flag: str, path: str | os.PathLike, *, create: bool = True) -> Path:
    """``path`` (given as ``flag``) is a file that can be written: not a folder, its folder created (``create=False``:
    creatable) and writable."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder; a file name is needed")
    check_out_dir(flag, out.parent, create=create)
    return out


def _check_writable_folder(flag: str, path: str | os.PathLike, folder: Path) -> None:
    """Creates ``folder`` and writes and removes a probe file in it; ``UsageError`` naming ``flag`` and ``path``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"{flag} {str(path)!r} is not writable: {error.strerror or error}") from None


def check_alfworld_data() -> Path | None:
    """``$ALFWORLD_DATA``, when set, names a folder (the official ALFWorld games); returns it (None when unset)."""
    value = os.environ.get(ALFWORLD_DATA_ENV)
    if not value:
        return None
    root = Path(value).expanduser()
    if not root.is_dir():
        raise UsageError(f"${ALFWORLD_DATA_ENV}={value!r} is not a folder")
    return root


def check_model_preset(flag: str, name: str) -> str:
    """``name`` (given as ``flag``) is an architecture preset of ``jaxopd.models.decoder`` (imports jax)."""
    from jaxopd.models.decoder import PRESETS

    if name.lower().replace("_", "-") not in PRESETS:
        raise UsageError(f"{flag} {name!r} is not a model preset; choose one of {sorted(PRESETS)}")
    return name


def check_random_preset(flag: str, name: str) -> str:
    """``name`` (given as ``flag``) is a preset that can run with random weights: with no model folder there is no
    tokenizer but the offline Qwen3 one (``jaxopd.tokenizer.load_tokenizer(None)``), so the preset's vocabulary must
    hold its ids (the Qwen3 presets do; a Llama preset such as ``smollm2-135m`` needs its folder, which carries its
    tokenizer). Imports jax."""
    from jaxopd.models.decoder import PRESETS
    from jaxopd.tokenizer import QWEN3_VOCAB_SIZE

    check_model_preset(flag, name)
    preset = PRESETS[name.lower().replace("_", "-")]
    if preset.vocab_size < QWEN3_VOCAB_SIZE:
        raise UsageError(f"{flag} {name!r} ({preset.model_type}, {preset.vocab_size:,} token ids) cannot run with "
                         "random weights: the only tokenizer without a model folder is Qwen3's "
                         f"({QWEN3_VOCAB_SIZE:,} ids); give the model's Hugging Face folder, which carries its "
                         "tokenizer (python -m experiments.fetch_model fetches smollm2-135m-instruct)")
    return name


def checkpoint_vocab_size(flag: str, path: str | os.PathLike) -> int:
    """The vocabulary size a Hugging Face checkpoint folder declares in its ``config.json`` (no weights read)."""
    folder = check_checkpoint_folder(flag, path)
    try:
        config = json.loads((folder / "config.json").read_text())
        return int(config.get("text_config", config)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{flag} {str(path)!r}: config.json gives no vocabulary size ({error})") from None


def check_same_vocabulary(student_vocab: int, teacher_vocab: int, *, student: str | None = None,
                          teacher: str | None = None) -> None:
    """On-policy distillation compares the two models token by token: one token space. ``student`` / ``teacher``:
    where each model comes from (e.g. ``--weights 'DIR'``), named in the message when given."""
    if teacher_vocab != student_vocab:
        teacher_from = f", {teacher}" if teacher else ""
        student_from = f", {student}" if student else ""
        raise UsageError(f"the teacher's vocabulary ({teacher_vocab} tokens{teacher_from}) differs from the "
                         f"student's ({student_vocab}{student_from}); OPD needs one token space")
