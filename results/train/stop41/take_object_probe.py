"""Stop 41's take-object probe: teacher-forced on the take turns of 24 generated games of a split (stop 40's
take_turns.take_samples, rendered in the given action format), how often the object's first token is the argmax
and its mean probability; as stop 39's probe, with the action format as an argument.

    python results/train/stop41/take_object_probe.py SPLIT FORMAT DIR [DIR ...]     # FORMAT: tight | spaced
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop40"))
from take_turns import take_samples  # noqa: E402

from jaxopd.models.weights import load_qwen3  # noqa: E402


def main() -> None:
    # the expert's references are built in worker processes the first time: spawn re-imports this file
    split, action_format, folders = sys.argv[1], sys.argv[2], sys.argv[3:]
    tok, takes = take_samples(split, folders[0], action_format)
    for folder in folders:
        model = load_qwen3(folder)
        forward = jax.jit(lambda t: jax.nn.log_softmax(model(t[None])[0].astype(jnp.float32), -1))  # noqa: B023
        probabilities, right = [], 0
        for s in takes:
            k = int(np.where(s.loss_weight == 2.0)[0][4])       # '<', 'action', '>', the verb, the object's first token
            logp = np.asarray(forward(jnp.asarray(s.tokens)))
            probabilities.append(np.exp(logp[k - 1, s.tokens[k]]))
            right += int(logp[k - 1].argmax() == s.tokens[k])
        print(f"{split} {action_format} {folder}: take turns {len(takes)}, object first token argmax right {right}, "
              f"mean p {np.mean(probabilities):.3f}", flush=True)


if __name__ == "__main__":
    main()
