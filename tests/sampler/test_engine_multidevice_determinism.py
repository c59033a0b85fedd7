"""The engine on a multi-device mesh: no step may read host arrays the engine already rewrote for a later step.

On CPU a jitted step can alias its numpy inputs (positions, page tables, tokens, sampling arrays), and the engine
reuses those buffers once a step is processed. A step sharded over several devices is processed when the replica
``np.asarray`` reads (device 0's) is ready; the other devices may still be running it then. When the engine
rewrote the buffers at that point (the next overlapped step's positions and page table, or a new run's arrays),
a lagging device computed with the next step's values, its tokens and KV replica diverged, and through the
step's collectives (FSDP-sharded weights) so did every device's log-probs: a sync-mode training run on 8 CPU
devices stopped being reproducible on a busy machine (``ratio_max`` 1.09 at version lag 0). The engine must
wait for every replica (``jax.block_until_ready``) before it reuses a step's host arrays.
"""
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopd.models.logprobs import token_log_probs
from jaxopd.models.decoder import CausalLM
from micro_models import MICRO, micro_config
from jaxopd.models.sharding import copy_to, named_shardings
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
from jaxopd.sampler.executor import DecodeBatch
from jaxopd.train.mesh import RolePlan, build_meshes
from jaxopd.train.sync import WeightSync

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

VOCAB = 512
CFG = micro_config(MICRO, vocab_size=VOCAB)
ENGINE = EngineConfig(max_slots=8, page_size=16, num_pages=8 * 8 + 1, max_seq_len=128, prefill_chunk=128,
                      max_prefill_tokens=1024, max_prefill_rows=4, eos_token_ids=(VOCAB - 1,), scoring=False)


def requests(round_, n=6, tokens=16, seed=0):
    """Seeded temperature-1 requests, half of them sharing a 40-token prefix (prefix sharing), staggered lengths."""
    rng = np.random.default_rng(seed + round_)
    shared = np.random.default_rng(seed).integers(0, VOCAB - 1, size=40).tolist()
    out = []
    for i in range(n):
        prompt = (shared if i % 2 == 0 else []) + rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 30))).tolist()
        out.append(Request(prompt, SamplingParams(max_new_tokens=tokens - (i % 3), temperature=1.0,
                                                  seed=1000 * round_ + i), request_id=f"{round_}-{i}"))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Deterministic: a decode step whose first replica is ready while another device still reads its host arrays
# ---------------------------------------------------------------------------------------------------------------
class _LaggingStep:
    """One dispatched decode step of a multi-device run: its host inputs (and a copy taken at dispatch) are read by
    a lagging device until someone waits for the whole step (``jax.block_until_ready`` on an output)."""

    def __init__(self, inputs, violations, index):
        self.inputs = [(array, array.copy()) for array in inputs]
        self.violations, self.index, self.done = violations, index, False

    def lagging_device_reads(self, when: str) -> None:
        if self.done:
            return
        for live, seen in self.inputs:
            if not np.array_equal(live, seen):
                self.violations.append(f"step {self.index}'s host inputs were rewritten before it finished on "
                                       f"every device ({when})")
                self.done = True       # report each step once
                return


class _ReplicatedOutput:
    """A decode output: ``np.asarray`` reads the first replica (ready), ``block_until_ready`` waits for them all."""

    def __init__(self, value, step: _LaggingStep):
        self.value, self.step = value, step

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype)

    def block_until_ready(self):
        self.step.lagging_device_reads("when it was waited for")
        self.step.done = True
        jax.block_until_ready(self.value)
        return self


def lagging_executor(engine, violations):
    """Wrap ``engine.executor.decode``: every earlier unfinished step's lagging device reads its inputs at each
    dispatch (the host has written this step's arrays by then)."""
    real_decode = engine.executor.decode
    steps: list[_LaggingStep] = []

    def decode(batch: DecodeBatch):
        for step in steps:
            step.lagging_device_reads(f"at the dispatch of step {len(steps)}")
        tokens = batch.tokens.value if isinstance(batch.tokens, _ReplicatedOutput) else batch.tokens
        s = batch.sampling
        inputs = [batch.positions, batch.page_table, batch.active, s.temperature, s.top_p, s.top_k, s.seeds]
        if isinstance(tokens, np.ndarray):
            inputs.append(tokens)
        step = _LaggingStep(inputs, violations, len(steps))
        steps.append(step)
        next_tokens, logprobs = real_decode(DecodeBatch(tokens, batch.positions, batch.page_table, batch.active, s))
        return _ReplicatedOutput(next_tokens, step), _ReplicatedOutput(logprobs, step)

    engine.executor.decode = decode
    return steps


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_host_arrays_are_not_rewritten_while_a_device_still_runs_the_step(overlap):
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    violations: list[str] = []
    config = dataclasses.replace(ENGINE, overlap=overlap)
    with Engine(model, config) as engine:
        steps = lagging_executor(engine, violations)
        for round_ in range(2):
            results = engine.generate(requests(round_))
            assert all(r.finish_reason in ("length", "stop") for r in results)
    for step in steps:
        step.lagging_device_reads("after the engine stopped")
    assert len(steps) > 10
    assert not violations, violations[:3]


# ---------------------------------------------------------------------------------------------------------------
# End to end on the disjoint rollout mesh: engine log-probs == a dense recompute with the trainer's weights
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices: the 4/2/2 role plan")
def test_engine_on_the_rollout_mesh_serves_the_synced_weights_under_load():
    model = CausalLM(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    meshes = build_meshes(RolePlan.for_device_count(8))
    trainer_params = copy_to(params, named_shardings(params, meshes.trainer))
    sync = WeightSync.for_mesh(params, meshes.rollout)
    length = ENGINE.max_seq_len

    @jax.jit
    def perturb(p, key):
        leaves, tree = jax.tree.flatten(p)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                         for x, k in zip(leaves, keys)])

    @jax.jit
    def dense(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens)
        return token_log_probs(logits[:, :-1], tokens[:, 1:], 1.0)

    # busy CPUs make the devices of one step finish far apart (the race needs a lagging device)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, os.cpu_count() or 2))]
    worst = []
    try:
        with Engine(model, ENGINE) as engine:
            for round_ in range(8):
                trainer_params = perturb(trainer_params, jax.random.key(round_))
                engine.update_weights(sync(trainer_params, round_ + 1).params, version=round_ + 1)
                reqs = requests(round_)
                results = engine.generate(reqs)
                host = jax.device_put(trainer_params, jax.devices()[0])
                rows = np.zeros((len(reqs), length), np.int32)
                for i, (req, res) in enumerate(zip(reqs, results)):
                    assert res.policy_versions == (round_ + 1, round_ + 1)
                    ids = list(req.prompt_ids) + list(res.token_ids)
                    rows[i, :len(ids)] = ids
                expected = np.asarray(dense(host, jnp.asarray(rows)))
                worst.append(max(float(np.max(np.abs(
                    expected[i, len(req.prompt_ids) - 1:len(req.prompt_ids) - 1 + len(res.token_ids)] - res.logprobs)))
                    for i, (req, res) in enumerate(zip(reqs, results))))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert max(worst) < 1e-4, [f"{w:.1e}" for w in worst]
