import os, sys, numpy as np, jax, jax.numpy as jnp
from jaxopd.methods.benchmarks import resolve_source, subset, GeneratedCounts, references_for
from jaxopd.methods.sft_data import walkthrough_samples
from jaxopd.models.weights import load_qwen3
from jaxopd.tokenizer import load_tokenizer
split=sys.argv[1]; folders=sys.argv[2:]
source = resolve_source("alfworld", "generated", counts=GeneratedCounts(), progress=False)
tasks = subset(source.tasks(split), 24, seed=0)
refs = references_for(source, tasks, workers=2, progress=False, kind="searching_expert", expert_max_turns=30)
tok = load_tokenizer(folders[0])
for thinking in ("task-tool-act-here",):
  samples,_ = walkthrough_samples(list(refs.values()), tok, max_prompt_tokens=1024, thinking=thinking, action_weight=2.0)
  takes=[s for s in samples if tok.decode(s.tokens[s.loss_weight==2.0]).startswith("<action>take")]
  for folder in folders:
    model = load_qwen3(folder)
    fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t[None])[0].astype(jnp.float32), -1))
    ps=[]; ok=0
    for s in takes:
        k = int(np.where(s.loss_weight == 2.0)[0][4])   # the object's first token
        lp = np.asarray(fwd(jnp.asarray(s.tokens)))
        ps.append(np.exp(lp[k-1, s.tokens[k]])); ok += int(lp[k-1].argmax()==s.tokens[k])
    print(f"{split} {folder}: take turns {len(takes)}, object first token argmax right {ok}, mean p {np.mean(ps):.3f}", flush=True)
