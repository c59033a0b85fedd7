"""Randomised request mixes for engine equivalence tests (overlapped vs synchronous, mixed vs separate steps), and
the character tokenizer their stop strings are checked with."""
from __future__ import annotations

import numpy as np

from jaxopd.sampler import Request, SamplingParams


def request_mix(n, seed, *, vocab, max_prompt=40, max_new=60, min_new_below=10, seed_base=100, score_every=0):
    """A mix: greedy and sampled (top-k, top-p), stop tokens with and without min_new_tokens, stop strings,
    staggered lengths and prompt lengths (so rows finish, admissions and prefills interleave with decode), and
    every ``score_every``-th one a score request (none when 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, max_prompt))).tolist()
        if score_every and i % score_every == score_every - 1:
            completion = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
            out.append(Request(prompt, SamplingParams(max_new_tokens=len(completion), temperature=0.7),
                               request_id=f"s{i}", score_ids=completion))
            continue
        kw = dict(max_new_tokens=int(rng.integers(1, max_new)), temperature=0.0 if i % 3 == 0 else 1.0,
                  seed=seed_base + i)
        if i % 4 == 1:
            kw.update(top_k=8, top_p=0.9)
        if i % 5 == 2:
            kw.update(stop_token_ids=(int(rng.integers(0, vocab)),),
                      min_new_tokens=min(kw["max_new_tokens"], int(rng.integers(0, min_new_below))))
        if i % 7 == 3:
            kw.update(stop_strings=("ab", "zz"))
        out.append(Request(prompt, SamplingParams(**kw), request_id=f"r{i}"))
    return out


def fixed_length_requests(n, *, vocab, new_tokens, seed=0):
    """``n`` requests of 3 to 39 random prompt ids that each generate exactly ``new_tokens`` tokens, sampled at
    temperature 0.9 and greedy in turn (seed = index): outputs two engine configurations must agree on."""
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, vocab, size=int(rng.integers(3, 40))).tolist(),
                    SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   temperature=0.0 if i % 2 else 0.9, seed=i))
            for i in range(n)]


class CharTokenizer:
    """Token t decodes to one letter (``t mod 26``), so stop strings can be hit by token ids."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)
