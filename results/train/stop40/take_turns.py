"""Stop 40's shared setup: the take turns of 24 generated games of a split, as SFT samples whose action tag is
marked (loss_weight 2.0; ``action_format`` as train's --sft-action-format), and the tokenizer; used by take_object_diagnosis.py and take_object_ablation.py."""
import numpy as np
from jaxopd.methods.benchmarks import resolve_source, subset, GeneratedCounts, references_for
from jaxopd.methods.sft_data import walkthrough_samples
from jaxopd.tokenizer import load_tokenizer


def take_samples(split, folder, action_format="tight"):
    source = resolve_source("alfworld", "generated", counts=GeneratedCounts(), progress=False)
    tasks = subset(source.tasks(split), 24, seed=0)
    refs = references_for(source, tasks, workers=2, progress=False, kind="searching_expert", expert_max_turns=30)
    tok = load_tokenizer(folder)
    samples, _ = walkthrough_samples(list(refs.values()), tok, max_prompt_tokens=1024,
                                     thinking="task-tool-act-here", action_weight=2.0, action_format=action_format)
    return tok, [s for s in samples
                 if tok.decode(s.tokens[s.loss_weight == 2.0]).replace("<action> ", "<action>").startswith("<action>take")]
