"""Weight sync trainer → rollout mesh: the rollout copy lives on the rollout devices with the rollout
shardings and equals the trainer parameters (bitwise, or their cast)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import ModelConfig, abstract_model
from jaxopd.models.sharding import named_shardings
from jaxopd.train import RolePlan, WeightSync, build_meshes, sync_weights

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")


def host_params(seed):
    graphdef, abstract = nnx.split(abstract_model(TINY), nnx.Param)
    rng = np.random.default_rng(seed)
    return graphdef, jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), jnp.float32), abstract)


def trainer_side_params(meshes):
    """Parameters on the trainer mesh after a trainer-side (sharded, jitted) change."""
    _, params = host_params(0)
    shardings = named_shardings(params, meshes.trainer)
    update = jax.jit(lambda p: jax.tree.map(lambda x: 0.9 * x + 0.01, p), in_shardings=(shardings,),
                     out_shardings=shardings)
    return update(jax.device_put(params, shardings))


def test_sync_makes_the_rollout_copy_equal_the_trainer_params():
    meshes = build_meshes(RolePlan.disjoint(4, 2, 2, trainer_tensor_parallel=2))
    trainer = trainer_side_params(meshes)
    sync = WeightSync.for_mesh(trainer, meshes.rollout)
    rollout = sync(trainer, version=7)
    assert rollout.version == 7
    expected = named_shardings(trainer, meshes.rollout)
    for (path, got), (_, want), (_, source) in zip(nnx.to_flat_state(rollout.params), nnx.to_flat_state(expected),
                                                   nnx.to_flat_state(trainer)):
        got, source = got.get_value(), source.get_value()
        assert got.sharding == want.get_value(), path
        assert got.sharding.device_set == meshes.devices_of("rollout"), path
        assert source.sharding.device_set == meshes.devices_of("trainer"), path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(source))
    assert rollout.params["embedding_vd"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "data")


def test_sync_casts_to_the_rollout_dtype_and_checks_the_structure():
    meshes = build_meshes(RolePlan.disjoint(4, 2, 2))
    trainer = trainer_side_params(meshes)
    rollout = WeightSync.for_mesh(trainer, meshes.rollout, dtype="bfloat16")(trainer, version=1)
    for got, source in zip(jax.tree.leaves(rollout.params), jax.tree.leaves(trainer)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(source).astype(jnp.bfloat16))
    plain = sync_weights(trainer, named_shardings(trainer, meshes.rollout))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, plain), jax.tree.map(np.asarray, trainer))
    other = ModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64, vocab_size=64)
    other_params = nnx.state(abstract_model(other), nnx.Param)
    with pytest.raises(ValueError, match="structure of the rollout shardings"):
        WeightSync(named_shardings(other_params, meshes.rollout))(trainer, version=1)


def test_colocated_rollout_copy_survives_a_donating_train_step():
    meshes = build_meshes(RolePlan.colocated_on(1))
    trainer = trainer_side_params(meshes)
    expected = jax.tree.map(np.asarray, trainer)
    rollout = WeightSync.for_mesh(trainer, meshes.rollout)(trainer, version=3)
    donating_update = jax.jit(lambda p: jax.tree.map(lambda x: x - 1.0, p), donate_argnums=0)
    trainer = donating_update(trainer)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(rollout.params))
    jax.tree.map(np.testing.assert_array_equal, expected, jax.tree.map(np.asarray, rollout.params))
