"""Stop 43: the share of rounds answering an arrival or an opening whose thinking copies the listed classes as the
rule writes them, by turn and by refusals so far in the episode (jaxopd.methods.transcripts counts the total).

    python results/train/stop43/listing_by_turn.py LABEL=EVAL_DIR [LABEL=EVAL_DIR ...]
"""
import json, sys
from collections import defaultdict
from jaxopd.methods.transcripts import _states, thinking_of
from jaxopd.methods.sft_data import listing_sentence
for label, path in [a.split('=') for a in sys.argv[1:]]:
    eps = json.load(open(path + '/evaluation.json'))['episodes']
    by = defaultdict(lambda: [0, 0]); prev_ref = defaultdict(lambda: [0, 0])
    for e in eps:
        goal, states = _states(e)
        for t, ans in enumerate(e['answers'][:len(e['actions'])]):
            th = thinking_of(ans); l = states[t].listed
            if th is None or l is None: continue
            ok = listing_sentence(l) in th
            b = 0 if t < 3 else 1 if t < 8 else 2 if t < 15 else 3
            by[b][0] += ok; by[b][1] += 1
            n_ref = sum(f.strip() == 'Nothing happens.' for f in e['feedback'][:t])
            k = 0 if n_ref == 0 else 1 if n_ref < 4 else 2
            prev_ref[k][0] += ok; prev_ref[k][1] += 1
    print(label, 'by turn [0-2,3-7,8-14,15+]:', [f"{by[b][0]}/{by[b][1]}" for b in range(4)],
          ' by refusals so far [0,1-3,4+]:', [f"{prev_ref[k][0]}/{prev_ref[k][1]}" for k in range(3)])
