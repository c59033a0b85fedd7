"""Serve a model with the paged-KV engine: chat prompts in, answers out, several at once.

Owns the command line that serves any model folder (Qwen3 or Llama) or fetched catalogue model
(``jaxopd.models.pretrained``) through ``jaxopd.sampler.Engine``: each prompt becomes a user turn of the model's
chat template (with ``--system``), all are submitted together (continuous batching), and each answer is printed
with its token count, finish reason and the engine's throughput.

    python -m experiments.generate --model smollm2-135m-instruct "What is a fridge for?" "Name three fruits."
    echo "Hello" | python -m experiments.generate --model /models/my-student --temperature 0
"""
from __future__ import annotations

import sys
import time

from jaxopd import cli

PROG = "python -m experiments.generate"


def build_parser() -> cli.Parser:
    p = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", nargs="*", help="user messages (default: one per line of standard input)")
    p.add_argument("--model", required=True, metavar="NAME|DIR",
                   help="a fetched catalogue model (e.g. smollm2-135m-instruct) or a Hugging Face model folder")
    p.add_argument("--system", default=None, help="a system message before each prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="default: a fresh seed per request")
    return p


def run(args) -> int:
    import math

    from jaxopd.models.pretrained import resolve_model_dir

    prompts = list(args.prompts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise cli.UsageError("no prompt given (as arguments or on standard input)")
    if args.max_new_tokens < 1:
        raise cli.UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise cli.UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    with cli.usage_errors():
        folder = cli.check_checkpoint_folder("--model", resolve_model_dir(args.model))

    from jaxopd.models.folders import load_folder
    from jaxopd.models.weights import CheckpointError
    from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
    from jaxopd.models.folders import load_folder_tokenizer

    with cli.usage_errors(CheckpointError, ValueError):
        model = load_folder(folder)
        tokenizer = load_folder_tokenizer(folder)
    messages = [[*([{"role": "system", "content": args.system}] if args.system else []),
                 {"role": "user", "content": prompt}] for prompt in prompts]
    encoded = [tokenizer.apply_chat_template(m, add_generation_prompt=True, enable_thinking=False, tokenize=True)
               for m in messages]
    longest = max(len(ids) for ids in encoded) + args.max_new_tokens
    page = 16
    max_seq_len = -(-longest // page) * page
    slots = min(64, len(encoded))
    config = EngineConfig(max_slots=slots, page_size=page, num_pages=slots * (max_seq_len // page) + 1,
                          max_seq_len=max_seq_len, prefill_chunk=min(512, max_seq_len))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    with Engine(model, config, tokenizer=tokenizer) as engine:
        start = time.perf_counter()
        futures = [engine.submit(Request(ids, params)) for ids in encoded]
        results = [future.result() for future in futures]
        elapsed = time.perf_counter() - start
    for prompt, result in zip(prompts, results):
        print(f"> {prompt}\n{result.text.strip()}\n[{len(result.token_ids)} tokens, {result.finish_reason}]\n")
    tokens = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} answers, {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s, compile "
          "included)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
