"""Stop 40: on the take turns of 24 generated games (teacher-forced), where does a model's wrong object class come
from?  For each take turn: the demonstrated object's first token, the model's argmax, and whether that argmax class
appears in the prompt's admissible commands (a copy of the wrong line) or nowhere in the prompt (a guess from
priors).  python results/train/stop40/take_object_diagnosis.py SPLIT MODEL_DIR..."""
import sys, collections, numpy as np, jax, jax.numpy as jnp
from jaxopd.models.weights import load_qwen3
from take_turns import take_samples
split = sys.argv[1]; folders = sys.argv[2:]
tok, takes = take_samples(split, folders[0])
for folder in folders:
    model = load_qwen3(folder)
    fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t[None])[0].astype(jnp.float32), -1))
    kinds = collections.Counter()
    for s in takes:
        k = int(np.where(s.loss_weight == 2.0)[0][4])
        prompt = tok.decode(s.tokens[:int(np.argmax(s.loss_mask))])
        lines = [l for l in prompt.splitlines() if l.startswith("take ")]
        lp = np.asarray(fwd(jnp.asarray(s.tokens)))
        guess = tok.decode([int(lp[k - 1].argmax())]).strip()
        target = tok.decode([int(s.tokens[k])]).strip()
        same = sum(l.split()[1].startswith(target) for l in lines)
        if guess == target:
            kinds["right"] += 1
        elif any(l.split()[1].startswith(guess) for l in lines):
            most = collections.Counter(l.split()[1] for l in lines).most_common(1)[0][0]
            kinds["wrong, an admissible take of the same receptacle" + (" (its most listed class)" if most.startswith(guess) else "")] += 1
        elif guess in prompt:
            kinds["wrong, named elsewhere in the prompt"] += 1
        else:
            kinds["wrong, nowhere in the prompt"] += 1
        kinds[f"target's class listed {min(same, 3)}{'+' if same >= 3 else ''} times"] += 1
    print(split, folder, len(takes), "take turns:", dict(sorted(kinds.items())), flush=True)
