"""Stop 40: the same take turns as take_object_diagnosis.py, teacher-forced twice: as demonstrated, and with every
other admissible ``take ...`` line deleted from the prompt (the demonstrated one kept). If the wrong objects come
from the list's other take lines, deleting them should put the right object on top.
python results/train/stop40/take_object_ablation.py SPLIT MODEL_DIR..."""
import sys, numpy as np, jax, jax.numpy as jnp
from jaxopd.models.weights import load_qwen3
from take_turns import take_samples
split = sys.argv[1]; folders = sys.argv[2:]
tok, takes = take_samples(split, folders[0])
cases = []
for s in takes:
    start = int(np.argmax(s.loss_mask))
    prompt, response = tok.decode(s.tokens[:start]), tok.decode(s.tokens[start:])
    action = response.split("<action>")[1].split("</action>")[0]
    ablated = "\n".join(l for l in prompt.split("\n") if not l.startswith("take ") or l == action)
    for variant, text in (("as demonstrated", prompt), ("other take lines deleted", ablated)):
        ids = list(tok.encode(text)); head = list(tok.encode(response.split("<action>")[0] + "<action>take"))
        cases.append((variant, np.asarray(ids + head, np.int32), tok.encode(" " + action.split()[1])[0]))
for folder in folders:
    model = load_qwen3(folder)
    fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t[None])[0, -1].astype(jnp.float32), -1))
    for variant in ("as demonstrated", "other take lines deleted"):
        ps = [np.asarray(fwd(jnp.asarray(ids)))[target] for v, ids, target in cases if v == variant]
        right = sum(int(np.asarray(fwd(jnp.asarray(ids))).argmax() == target) for v, ids, target in cases if v == variant)
        print(f"{split} {folder} {variant}: {len(ps)} take turns, object first token argmax right {right}, "
              f"mean p {np.mean(np.exp(ps)):.3f}", flush=True)
