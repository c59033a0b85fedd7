"""Stop 41: how often the SFT corpus's thinking says what its prompt no longer shows.

A demonstration's thinking (task-tool-act-here) is computed from the turn's full history, while its prompt keeps
only the newest history pairs that fit --max-prompt-tokens. For each demonstration turn of the seeded training
games (the teacher's SFT corpus, no renamed copies), this recomputes the thinking from the history the rendered
prompt keeps and counts the turns where the two differ, and which sentence differs.

    python results/train/stop41/hidden_state.py [SPLIT [NUM_TASKS]]      # default: the SFT corpus's train games
"""
import collections
import dataclasses
import sys

from jaxopd.methods.benchmarks import GeneratedCounts, references_for, resolve_source, subset
from jaxopd.methods.config import build_config
from jaxopd.methods.sft_data import SFT_MODE, thinking_text, walkthrough_turns
from jaxopd.rollout.prompts import render_prompt
from jaxopd.tokenizer import Qwen3Tokenizer

config = build_config("sft", preset="cpu", sft_demonstrations="searching-expert", max_turns=30)
split = sys.argv[1] if len(sys.argv) > 1 else "train"
source = resolve_source("alfworld", "generated", counts=GeneratedCounts(), progress=False)
tasks = (subset(source.tasks("train"), config.train_tasks, seed=config.seed) if split == "train"
         else subset(source.tasks(split), int(sys.argv[2]) if len(sys.argv) > 2 else 24, seed=0))
references = references_for(source, tasks, workers=2, progress=False, kind="searching_expert", expert_max_turns=30)
tok = Qwen3Tokenizer()
turns = truncated = differs = 0
sentences = collections.Counter()
for reference in references.values():
    for turn in walkthrough_turns(reference):
        turns += 1
        prompt = render_prompt(tok, SFT_MODE, turn.inputs, config.max_prompt_tokens)
        history = tuple(turn.inputs.history)
        if prompt.history_pairs_kept == len(history):
            continue
        truncated += 1
        full = thinking_text(turn.inputs, "task-tool-act-here")
        kept = history[len(history) - prompt.history_pairs_kept:]
        seen = thinking_text(dataclasses.replace(turn.inputs, history=kept), "task-tool-act-here")
        if full != seen:
            differs += 1
            for sentence in set(full.split(". ")) - set(seen.split(". ")):
                sentences[" ".join(sentence.split()[:2])] += 1
print(f"{split}: {len(references)} games, {turns} demonstration turns, {truncated} with history dropped from the "
      f"prompt ({truncated / turns:.1%}), {differs} whose thinking says what the kept history does not "
      f"({differs / turns:.1%})")
print("sentences only the full history supports (first two words):", dict(sentences.most_common(12)))
