"""Sharding rules: logical axes → partition specs (hand-written expectations), replication of
non-divisible dimensions, placing a model and loading a checkpoint straight into shardings."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxopd.models.decoder import ModelConfig, abstract_model
from jaxopd.models.sharding import (QWEN3_LOGICAL_AXES, ShardingRules, loader_sharding, logical_partition_spec,
                                    named_shardings, partition_specs, shard_model)

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                   vocab_size=64, dtype="float32", param_dtype="float32")


def make_mesh(data, model):
    devices = np.asarray(jax.devices()[:data * model], dtype=object).reshape(data, model)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def flat_specs(specs):
    return {"/".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(specs)}


def test_fsdp_tensor_specs_of_every_qwen3_parameter():
    untied = nnx.state(abstract_model(ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": False})), nnx.Param)
    used_axes = {axis for _, var in nnx.to_flat_state(untied) for axis in var.get_metadata()["axes"]}
    assert used_axes == set(QWEN3_LOGICAL_AXES)
    for rules in (ShardingRules.fsdp(), ShardingRules.fsdp_tensor()):
        assert all(isinstance(rules.mesh_axes(axis), tuple) for axis in QWEN3_LOGICAL_AXES)
    mesh = make_mesh(4, 2)
    specs = flat_specs(partition_specs(nnx.state(abstract_model(TINY), nnx.Param), ShardingRules.fsdp_tensor(), mesh))
    assert specs["embedding_vd"] == P("model", "data")
    assert specs["final_norm/scale"] == P("data")
    layer = {k.split("/", 2)[2]: v for k, v in specs.items() if k.startswith("layers/1/")}
    assert layer == {
        "attn/q_weight_dnh": P("data", "model"),
        "attn/k_weight_dkh": P("data", "model"),
        "attn/v_weight_dkh": P("data", "model"),
        "attn/o_weight_nhd": P("model", None, "data"),
        "attn/q_norm/scale": P(),
        "attn/k_norm/scale": P(),
        "mlp/gate_weight_df": P("data", "model"),
        "mlp/up_weight_df": P("data", "model"),
        "mlp/down_weight_fd": P("model", "data"),
        "input_norm/scale": P("data"),
        "post_attention_norm/scale": P("data"),
    }


def test_indivisible_dimensions_are_replicated():
    mesh = make_mesh(2, 4)   # 2 KV heads cannot split over 4 tensor-parallel devices
    specs = flat_specs(partition_specs(nnx.state(abstract_model(TINY), nnx.Param), ShardingRules.fsdp_tensor(), mesh))
    assert specs["layers/0/attn/k_weight_dkh"] == P("data")
    assert specs["layers/0/attn/q_weight_dnh"] == P("data", "model")
    assert logical_partition_spec(("vocab", "embed"), (63, 32), make_mesh(4, 2)) == P(None, "data")
    assert logical_partition_spec(("vocab", "embed"), (64, 30), make_mesh(4, 2)) == P("model")


def test_multi_axis_rules_keep_the_longest_dividing_prefix_and_never_reuse_a_mesh_axis():
    mesh = make_mesh(4, 2)
    rules = ShardingRules.from_mapping({"embed": ("data", "model"), "mlp": "data"})
    assert logical_partition_spec(("embed",), (32,), mesh, rules) == P(("data", "model"))
    assert logical_partition_spec(("embed",), (12,), mesh, rules) == P("data")
    assert logical_partition_spec(("embed", "mlp"), (32, 64), mesh, rules) == P(("data", "model"))
    assert logical_partition_spec(("mlp", "embed"), (64, 32), mesh, rules) == P("data", "model")
    # a mesh without the tensor axis drops it; without a mesh the rules apply as written
    assert logical_partition_spec(("embed",), (32,), make_mesh(8, 1), rules) == P("data")
    assert logical_partition_spec(("embed",), (7,), None, rules) == P(("data", "model"))
    assert ShardingRules.fsdp().mesh_axes("embed") == ("data",) and ShardingRules.fsdp().mesh_axes("vocab") == ()


def test_bad_rules_and_missing_metadata_raise_clear_errors():
    with pytest.raises(ValueError, match="no rule for logical axis 'experts'"):
        logical_partition_spec(("experts",), (8,), make_mesh(4, 2))
    with pytest.raises(ValueError, match="two rules"):
        ShardingRules((("embed", ("data",)), ("embed", ())))
    with pytest.raises(ValueError, match="rank"):
        logical_partition_spec(("embed",), (8, 8), None)
    bare = nnx.State({"w": nnx.Param(jax.numpy.zeros((4,)))})
    with pytest.raises(ValueError, match="no 'axes' metadata"):
        partition_specs(bare, mesh=make_mesh(4, 2))


def test_shard_model_places_parameters_without_changing_values():
    mesh = make_mesh(4, 2)
    graphdef, abstract = nnx.split(abstract_model(TINY), nnx.Param)
    rng = np.random.default_rng(0)
    model = nnx.merge(graphdef, jax.tree.map(lambda s: jax.numpy.asarray(rng.standard_normal(s.shape), "float32"),
                                             abstract))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    shard_model(model, mesh)
    after = nnx.state(model, nnx.Param)
    expected = named_shardings(after, mesh)
    for (path, var), (_, sharding) in zip(nnx.to_flat_state(after), nnx.to_flat_state(expected)):
        assert var.get_value().sharding == sharding.get_value(), path
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, after))
    assert model.embedding_vd[...].sharding.spec == P("model", "data")
    assert {s.device for s in model.embedding_vd[...].addressable_shards} == set(jax.devices())


def test_checkpoint_loads_straight_into_shardings(tmp_path):
    from conftest import make_hf_qwen3
    from jaxopd.models.weights import load_model, read_config

    make_hf_qwen3(tmp_path, tied=False)
    mesh = make_mesh(4, 2)
    abstract_params = nnx.state(abstract_model(read_config(tmp_path, dtype="float32")), nnx.Param)
    sharded = load_model(tmp_path, dtype="float32", sharding=loader_sharding(abstract_params, mesh))
    plain = load_model(tmp_path, dtype="float32")
    assert sharded.lm_head_dv[...].sharding.spec == P("data", "model")      # ('embed', 'vocab')
    assert sharded.layers[0].mlp.down_weight_fd[...].sharding.spec == P("model", "data")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(plain, nnx.Param)),
                 jax.tree.map(np.asarray, nnx.state(sharded, nnx.Param)))
