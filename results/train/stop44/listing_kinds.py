"""Stop 44: what a model's free-running listing sentence is, where the demonstration copies one.

Reads a `python -m experiments.demo_fit --free-running` JSON (24 `valid_unseen` games, searching expert, a
thinking rule that copies listings), rebuilds its demonstration samples, and sorts each answer's
"Here: ..." sentence (``sft_data.listing_said``) against the demonstrated one: exact; the same classes in
another order; a subset; some right and some not; none right; no listing at all.

    python results/train/stop44/listing_kinds.py FIT.json MODEL [MODEL ...]
"""
import collections
import json
import sys

import numpy as np

from jaxopd.methods.benchmarks import GeneratedCounts, references_for, resolve_source, subset
from jaxopd.methods.demo_fit import _prompt_and_demonstration
from jaxopd.methods.sft_data import listing_said, walkthrough_samples
from jaxopd.methods.transcripts import thinking_of
from jaxopd.tokenizer import load_tokenizer

KINDS = ("exact", "same classes, other order", "subset", "some right, some not", "none right", "no listing")


def kind_of(want: str, got: str | None) -> str:
    if got == want:
        return "exact"
    if got is None:
        return "no listing"
    wanted, said = set(want[len("Here: "):-1].split(", ")), set(got[len("Here: "):-1].split(", "))
    if said == wanted:
        return "same classes, other order"
    if said < wanted:
        return "subset"
    return "some right, some not" if said & wanted else "none right"


def main(path: str, models: list[str]) -> None:
    fit = json.load(open(path))
    source = resolve_source("alfworld", "generated", counts=GeneratedCounts(), progress=False)
    tasks = subset(source.tasks(fit["split"]), 24, seed=0)
    references = references_for(source, tasks, workers=1, progress=False, kind="searching_expert",
                                expert_max_turns=30)
    tokenizer = load_tokenizer(models[0])
    samples = []
    for reference in references.values():
        samples += walkthrough_samples([reference], tokenizer, max_prompt_tokens=1024, thinking=fit["thinking"],
                                       action_format=fit["action_format"])[0]
    if len(samples) != fit["turns"]:
        raise SystemExit(f"{path} scored {fit['turns']} turns; rebuilt {len(samples)}")
    distances = []
    for sample in samples:
        prompt, demonstration = _prompt_and_demonstration(sample, tokenizer)
        if listing_said(thinking_of(demonstration)) is not None:
            text = tokenizer.decode(prompt)
            tail = text[text.rindex("Current observation:"):]
            distances.append(len(tokenizer.encode(tail)))
    print(f"# python results/train/stop44/listing_kinds.py {path} {' '.join(models)}")
    print(f"prompt tokens from the current observation's start to the answer, over the listing turns: median "
          f"{int(np.median(distances))}, range {min(distances)}-{max(distances)}")
    print("| model | listing turns | " + " | ".join(KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for model in models:
        kinds = collections.Counter()
        for sample, answer in zip(samples, fit["free_running_answers"][model]):
            want = listing_said(thinking_of(_prompt_and_demonstration(sample, tokenizer)[1]))
            if want is not None:
                kinds[kind_of(want, listing_said(thinking_of(answer)))] += 1
        print(f"| `{model}` | {sum(kinds.values())} | " + " | ".join(str(kinds[k]) for k in KINDS) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
