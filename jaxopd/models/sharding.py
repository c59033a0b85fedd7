"""Logical parameter axes → mesh axes: the sharding rules of the model and their application to a mesh.

Owns the rule table (FSDP over a ``'data'`` mesh axis, an optional tensor-parallel ``'model'`` axis), the
partition spec of every parameter from its ``axes`` metadata (a dimension the mesh axis does not divide
is replicated), and placing a model's parameters on a mesh.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = tuple[str, ...]

DATA_AXIS = "data"
MODEL_AXIS = "model"

MODEL_LOGICAL_AXES = ("vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp")
"""Every logical axis name a ``jaxopd.models.decoder`` parameter carries (Qwen3 and Llama alike: Qwen3's q/k norms
are over ``head_dim``)."""
QWEN3_LOGICAL_AXES = MODEL_LOGICAL_AXES     # the name before the Llama family (kept for existing callers)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A table from logical axis names to the mesh axes that split them (empty tuple: replicated).

    Build with :meth:`fsdp`, :meth:`fsdp_tensor` or ``ShardingRules.from_mapping({...})``. A mesh axis the
    mesh does not have (or of size 1) is ignored when the rules are applied, so one table serves meshes
    with and without a tensor axis.
    """

    table: tuple[tuple[str, MeshAxes], ...]

    def __post_init__(self):
        seen = set()
        for logical, mesh_axes in self.table:
            if not isinstance(logical, str) or not logical:
                raise ValueError(f"ShardingRules: logical axis names must be non-empty strings, got {logical!r}")
            if logical in seen:
                raise ValueError(f"ShardingRules: logical axis {logical!r} has two rules")
            seen.add(logical)
            if not isinstance(mesh_axes, tuple) or not all(isinstance(a, str) and a for a in mesh_axes):
                raise ValueError(f"ShardingRules: the mesh axes of {logical!r} must be a tuple of names, "
                                 f"got {mesh_axes!r}")
            if len(set(mesh_axes)) != len(mesh_axes):
                raise ValueError(f"ShardingRules: {logical!r} names a mesh axis twice: {mesh_axes!r}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str | Sequence[str] | None]) -> "ShardingRules":
        """``{'embed': 'data', 'mlp': ('model',), 'head_dim': None, ...}`` → rules."""
        def as_axes(value):
            if value is None:
                return ()
            if isinstance(value, str):
                return (value,)
            return tuple(value)
        return cls(tuple((logical, as_axes(value)) for logical, value in mapping.items()))

    @classmethod
    def fsdp(cls, data_axis: str = DATA_AXIS) -> "ShardingRules":
        """Fully sharded data parallel: every parameter split along its hidden (``embed``) dimension."""
        return cls.from_mapping({"vocab": None, "embed": data_axis, "q_heads": None, "kv_heads": None,
                                 "head_dim": None, "mlp": None})

    @classmethod
    def fsdp_tensor(cls, data_axis: str = DATA_AXIS, model_axis: str = MODEL_AXIS) -> "ShardingRules":
        """FSDP over ``data_axis`` plus Megatron-style tensor parallelism over ``model_axis``.

        Attention heads, MLP hidden units and the vocabulary split over the tensor axis; the hidden
        dimension over the data axis. On a mesh without ``model_axis`` this is plain FSDP.
        """
        return cls.from_mapping({"vocab": model_axis, "embed": data_axis, "q_heads": model_axis,
                                 "kv_heads": model_axis, "head_dim": None, "mlp": model_axis})

    def mesh_axes(self, logical: str) -> MeshAxes:
        for name, mesh_axes in self.table:
            if name == logical:
                return mesh_axes
        raise ValueError(f"ShardingRules: no rule for logical axis {logical!r} "
                         f"(rules cover {[name for name, _ in self.table]})")


DEFAULT_RULES = ShardingRules.fsdp_tensor()


def logical_partition_spec(axes: Sequence[str], shape: Sequence[int], mesh: Mesh | None,
                           rules: ShardingRules = DEFAULT_RULES) -> PartitionSpec:
    """The partition spec of one array with logical ``axes`` and ``shape`` on ``mesh``.

    Each dimension takes the mesh axes its rule names, skipping those the mesh lacks, those of size 1 and
    those an earlier dimension already took; it keeps the longest prefix of them whose total size divides
    the dimension (none: the dimension is replicated). With ``mesh=None`` only the rules are applied.
    """
    axes, shape = tuple(axes), tuple(shape)
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match the array rank of shape {shape}")
    used: set[str] = set()
    spec: list[Any] = []
    for logical, size in zip(axes, shape):
        wanted = [a for a in rules.mesh_axes(logical) if a not in used]
        if mesh is not None:
            wanted = [a for a in wanted if mesh.shape.get(a, 1) > 1]
            while wanted and size % math.prod(mesh.shape[a] for a in wanted):
                wanted.pop()
        used.update(wanted)
        spec.append(None if not wanted else wanted[0] if len(wanted) == 1 else tuple(wanted))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _variable_shape(variable: nnx.Variable) -> tuple[int, ...]:
    return tuple(variable.get_value().shape)


def _variable_axes(path: tuple[Any, ...], variable: nnx.Variable) -> tuple[str, ...]:
    axes = variable.get_metadata().get("axes")
    if axes is None:
        raise ValueError(f"parameter {'/'.join(map(str, path))} has no 'axes' metadata to shard it by")
    return tuple(axes)


def partition_specs(state: nnx.State, rules: ShardingRules = DEFAULT_RULES, mesh: Mesh | None = None) -> nnx.State:
    """A state of the same structure whose values are the ``PartitionSpec`` of each parameter.

    ``state`` may hold arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``nnx.eval_shape``). Pass ``mesh`` so
    that dimensions its axes do not divide are replicated.
    """
    flat = [(path, variable.replace(logical_partition_spec(_variable_axes(path, variable),
                                                           _variable_shape(variable), mesh, rules)))
            for path, variable in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def named_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> nnx.State:
    """A state of the same structure whose values are the ``NamedSharding`` of each parameter on ``mesh``."""
    specs = partition_specs(state, rules, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def copy_to(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` into new buffers: never aliases a source array (a copy is made
    where source and target share devices), so donating either side later cannot delete the other."""
    def put(x, sharding):
        placed = jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and x.sharding.device_set & sharding.device_set:
            placed = placed.copy()
        return placed

    return jax.tree.map(put, tree, shardings)


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> nnx.Module:
    """Moves the model's parameters onto ``mesh`` by their logical axes (in place) and returns the model."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, named_shardings(state, mesh, rules)))
    return model


def loader_sharding(abstract_state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
                    ) -> Callable[[tuple[Any, ...], tuple[int, ...]], NamedSharding]:
    """The ``sharding(path, shape)`` callable of ``jaxopd.models.weights.load_model`` for ``mesh``.

    ``abstract_state``: the parameter state of the architecture, e.g.
    ``nnx.state(abstract_model(cfg), nnx.Param)``; it supplies each path's logical axes.
    """
    axes_by_path = {path: _variable_axes(path, variable) for path, variable in nnx.to_flat_state(abstract_state)}

    def sharding(path: tuple[Any, ...], shape: tuple[int, ...]) -> NamedSharding:
        if path not in axes_by_path:
            raise ValueError(f"no parameter {'/'.join(map(str, path))} in the abstract state")
        return NamedSharding(mesh, logical_partition_spec(axes_by_path[path], shape, mesh, rules))

    return sharding


__all__ = ["DATA_AXIS", "MODEL_AXIS", "MODEL_LOGICAL_AXES", "QWEN3_LOGICAL_AXES", "ShardingRules", "DEFAULT_RULES",
           "logical_partition_spec", "partition_specs", "named_shardings", "copy_to", "shard_model",
           "loader_sharding"]
