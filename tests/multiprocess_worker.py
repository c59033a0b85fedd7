"""One process of a multi-process train run on CPU, launched by tests/train/test_train_multiprocess.py.

    JAX_PLATFORMS=cpu python tests/multiprocess_worker.py --process-id I --num-processes N \
        --coordinator localhost:PORT --out FILE

Every process builds the same micro Qwen3 from a fixed seed, the trainer mesh over all processes' devices
(one CPU device per process: data axis N) and only its own rows of a fixed 4-row batch (each row drawn from
its own seed), runs three ``opd`` train steps and gathers the final parameters to the host; the primary
process writes the per-step metrics, the parameters' sums and L2 norms and every final parameter value as
JSON. With
``--num-processes 1`` the same three steps run single-process on one device.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from jaxopd.train import distributed  # noqa: E402  (imports jax but makes no JAX call)

GLOBAL_ROWS = 4
LENGTH = 12
STEPS = 3
SEED = 0
FULL_LEAF = "final_norm/scale"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def micro_config():
    from jaxopd.models.decoder import ModelConfig
    return ModelConfig(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                       vocab_size=32, dtype="float32", param_dtype="float32")


def micro_params(cfg, seed):
    """Parameters drawn on the host from ``seed`` (identical on every process): N(0, 0.1) weights, norm
    scales 1 + N(0, 0.1)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxopd.models.decoder import abstract_model

    graphdef, abstract = nnx.split(abstract_model(cfg), nnx.Param)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        shape = var.get_value().shape
        value = (1.0 if path[-1] == "scale" else 0.0) + 0.1 * rng.standard_normal(shape)
        flat.append((path, var.replace(jnp.asarray(value, jnp.float32))))
    return graphdef, nnx.from_flat_state(flat)


def make_rows(rows, vocab_size):
    """The samples of global rows ``rows`` (a slice); row ``i`` is drawn from its own seed ``(SEED, i)``, so a
    process builds its rows without the others'."""
    import numpy as np

    from jaxopd.train.buffer import Sample

    samples = []
    for i in range(rows.start, rows.stop):
        rng = np.random.default_rng([SEED, i])
        length = int(rng.integers(6, LENGTH + 1))
        prompt = int(rng.integers(1, 4))
        tokens = rng.integers(0, vocab_size, length)
        mask = np.arange(length) >= prompt
        uniform = -np.log(vocab_size)
        behavior = np.where(mask, uniform + 0.1 * rng.standard_normal(length), 0.0)
        teacher = uniform + rng.standard_normal(length)
        samples.append(Sample(tokens, mask, behavior, 0, teacher_logp=teacher))
    return samples


def main(argv=None):
    args = parse_args(argv)
    config = distributed.DistributedConfig(args.coordinator, args.num_processes, args.process_id)
    distributed.initialize(config)               # before any other JAX call

    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from jaxopd.train.buffer import collate_samples
    from jaxopd.train.mesh import RolePlan, build_meshes
    from jaxopd.train.state import (OptimizerConfig, batch_shardings, init_train_state, make_optimizer,
                                    train_state_shardings)
    from jaxopd.train.step import LossConfig, make_train_step

    assert jax.process_count() == args.num_processes, (jax.process_count(), args.num_processes)
    assert jax.local_device_count() == 1, jax.local_devices()
    cfg = micro_config()
    graphdef, params = micro_params(cfg, SEED)
    mesh = build_meshes(RolePlan.colocated_on(jax.device_count())).trainer
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0))
    state_shardings = train_state_shardings(params, optimizer, mesh)
    row_shardings = batch_shardings(mesh)

    rows = distributed.process_local_rows(GLOBAL_ROWS)
    assert rows == distributed.process_local_rows(GLOBAL_ROWS, row_shardings.tokens), rows
    local = collate_samples(make_rows(rows, cfg.vocab_size), length=LENGTH)
    batch = distributed.global_batch(local, row_shardings, GLOBAL_ROWS)

    step = make_train_step(graphdef, optimizer, LossConfig(kind="opd"), state_shardings, row_shardings)
    state = init_train_state(params, optimizer, state_shardings)
    metrics = []
    for _ in range(STEPS):
        state, step_metrics = step(state, batch)
        metrics.append({name: float(value) for name, value in step_metrics.items()})
    final = distributed.host_params(state.params)
    # host_params agrees with multihost_utils.process_allgather(tiled=True), leaf by leaf
    gathered = multihost_utils.process_allgather(state.params, tiled=True)
    for mine, theirs in zip(jax.tree.leaves(final), jax.tree.leaves(gathered)):
        assert isinstance(mine, np.ndarray) and np.array_equal(mine, theirs)
    initial = jax.tree.leaves(micro_params(cfg, SEED)[1])
    param_change = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(final), initial))
    leaves = {"/".join(map(str, path)): np.asarray(var.get_value(), np.float64)
              for path, var in nnx.to_flat_state(final)}
    result = dict(
        process_count=jax.process_count(), device_count=jax.device_count(), mesh_shape=dict(mesh.shape),
        local_rows=[rows.start, rows.stop], step=int(np.asarray(distributed.host_params(state.step))),
        losses=[m["loss"] for m in metrics], grad_norms=[m["grad_norm"] for m in metrics], metrics=metrics,
        param_change=param_change,
        param_sums={k: float(v.sum()) for k, v in leaves.items()},
        param_norms={k: float(np.sqrt((v ** 2).sum())) for k, v in leaves.items()},
        full_leaf={FULL_LEAF: leaves[FULL_LEAF].tolist()},
        params={k: v.tolist() for k, v in leaves.items()},      # the micro model is small: every value
        embedding_sharding=str(state.params["embedding_vd"].get_value().sharding.spec))
    if distributed.is_primary():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    print(f"process {jax.process_index()}/{jax.process_count()}: losses {result['losses']}", flush=True)


if __name__ == "__main__":
    main()
