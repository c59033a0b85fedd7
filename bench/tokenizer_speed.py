"""Encode and decode speed of jaxopd's own Qwen3 tokenizer beside the transformers one built from the same files.

Both tokenizers encode the same ~2,000-token prompt (varied scripts, digits, emoji, chat tags) and decode
its ids, ``--repeats`` times each (one tokenizer after the other); the median time per call is reported.
Prints a markdown table, writes JSON to ``--out`` and the table beside it. (This replaced a timed unit test:
speed is measured here, never asserted in ``tests/``.)

    python -m bench.tokenizer_speed --out results/bench/tokenizer_speed.json
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Sequence

from bench.common import write_result
from jaxopd.cli import Parser, UsageError, check_out_file, run_main
from jaxopd.machine import machine_info
from jaxopd.tokenizer import Qwen3Tokenizer, load_tokenizer, write_hf_tokenizer_files

TEXT = ("<|im_start|>user\nYou are in the middle of a room. Looking quickly around you, you see a cabinet 4, "
        "a countertop 1, a drawer 2 and a sinkbasin 1.\nYour task is to: put a clean mug in the coffeemachine."
        "<|im_end|>\n<|im_start|>assistant\n<think>\nThe mug is probably on the countertop 1 (café, naïve, "
        "Ångström, 你好世界, 日本語, مرحبا, 12345, 3.14159, 👍🏽, 👨‍👩‍👧).\n</think>\n\n<action>go to countertop 1"
        "</action><|im_end|>\n")


def measure(fn, argument, repeats: int) -> float:
    """Median seconds of ``fn(argument)`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(argument)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m bench.tokenizer_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length in tokens (about)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="results/bench/tokenizer_speed.json")
    args = parser.parse_args(argv)
    return run_main(lambda: run(args, argv))


def run(args, argv) -> int:
    for flag in ("tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    check_out_file("--out", args.out)
    ours = Qwen3Tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        theirs = load_tokenizer(write_hf_tokenizer_files(folder))
        unit = ours.encode(TEXT)
        ids = (unit * (args.tokens // len(unit) + 1))[:args.tokens]
        prompt = ours.decode(ids)
        rows = []
        for name, tok in (("jaxopd Qwen3Tokenizer", ours), ("transformers (HFTokenizer)", theirs)):
            n = len(tok.encode(prompt))
            encode_s = measure(tok.encode, prompt, args.repeats)
            decode_s = measure(tok.decode, ids, args.repeats)
            rows.append({"tokenizer": name, "tokens": n,
                         "encode_ms": 1e3 * encode_s, "decode_ms": 1e3 * decode_s})
    table = ("| tokenizer | tokens | encode (ms, median) | decode (ms, median) |\n"
             "|---|---:|---:|---:|\n") + "".join(
        f"| {r['tokenizer']} | {r['tokens']} | {r['encode_ms']:.2f} | {r['decode_ms']:.2f} |\n" for r in rows)
    result = {"command": "python -m bench.tokenizer_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(devices=False), "repeats": args.repeats, "rows": rows}
    write_result(result, table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
