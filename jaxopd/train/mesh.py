"""The three device meshes of a distillation run — rollout, teacher, trainer — built from a role plan.

Owns the role plan (how many devices each role gets and its tensor-parallel width, disjoint or colocated)
with its validation, and the ``('data', 'model')`` meshes over the devices it assigns.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxopd.models.sharding import DATA_AXIS, MODEL_AXIS

ROLES = ("rollout", "teacher", "trainer")
MESH_AXES = (DATA_AXIS, MODEL_AXIS)


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One role's share: ``devices`` in total, ``tensor_parallel`` of them along the ``'model'`` axis."""

    devices: int
    tensor_parallel: int = 1

    def __post_init__(self):
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"RoleSpec.devices must be a positive integer, got {self.devices!r}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"RoleSpec.tensor_parallel must be a positive integer, got {self.tensor_parallel!r}")
        if self.devices % self.tensor_parallel:
            raise ValueError(f"RoleSpec: tensor_parallel={self.tensor_parallel} does not divide "
                             f"devices={self.devices}")

    @property
    def data_parallel(self) -> int:
        return self.devices // self.tensor_parallel


@dataclasses.dataclass(frozen=True)
class RolePlan:
    """Devices of the rollout engines, the teacher scorer and the trainer.

    Disjoint (default): rollout takes the first devices, then the teacher, then the trainer — the paper's
    8 GPUs are ``RolePlan.disjoint(4, 2, 2)``. Colocated: every role uses the same devices (one device:
    ``RolePlan.colocated(1)``).
    """

    rollout: RoleSpec
    teacher: RoleSpec
    trainer: RoleSpec
    colocated: bool = False

    def __post_init__(self):
        for role in ROLES:
            if not isinstance(getattr(self, role), RoleSpec):
                raise ValueError(f"RolePlan.{role} must be a RoleSpec, got {getattr(self, role)!r}")
        if self.colocated and len({self.rollout.devices, self.teacher.devices, self.trainer.devices}) != 1:
            raise ValueError("a colocated RolePlan gives every role the same devices, so their device counts must "
                             f"be equal; got rollout={self.rollout.devices}, teacher={self.teacher.devices}, "
                             f"trainer={self.trainer.devices}")

    @classmethod
    def disjoint(cls, rollout: int, teacher: int, trainer: int, *, rollout_tensor_parallel: int = 1,
                 teacher_tensor_parallel: int = 1, trainer_tensor_parallel: int = 1) -> "RolePlan":
        return cls(RoleSpec(rollout, rollout_tensor_parallel), RoleSpec(teacher, teacher_tensor_parallel),
                   RoleSpec(trainer, trainer_tensor_parallel))

    @classmethod
    def colocated_on(cls, devices: int, *, tensor_parallel: int = 1) -> "RolePlan":
        spec = RoleSpec(devices, tensor_parallel)
        return cls(spec, spec, spec, colocated=True)

    @classmethod
    def for_device_count(cls, count: int) -> "RolePlan":
        """The default plan: the paper's 2:1:1 split (rollout:teacher:trainer) when 4 divides ``count``,
        otherwise all roles colocated on every device."""
        if count < 1:
            raise ValueError(f"RolePlan.for_device_count needs at least one device, got {count}")
        if count % 4 == 0:
            quarter = count // 4
            return cls.disjoint(2 * quarter, quarter, quarter)
        return cls.colocated_on(count)

    @property
    def devices_needed(self) -> int:
        if self.colocated:
            return self.trainer.devices
        return self.rollout.devices + self.teacher.devices + self.trainer.devices


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    """The three meshes, each with axes ``('data', 'model')``."""

    rollout: Mesh
    teacher: Mesh
    trainer: Mesh
    plan: RolePlan

    def devices_of(self, role: str) -> frozenset:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        return frozenset(getattr(self, role).devices.flat)


def role_mesh(devices: Sequence[jax.Device], spec: RoleSpec) -> Mesh:
    """A ``('data', 'model')`` mesh of shape ``(devices / tensor_parallel, tensor_parallel)``."""
    grid = np.asarray(list(devices), dtype=object).reshape(spec.data_parallel, spec.tensor_parallel)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def build_meshes(plan: RolePlan, devices: Sequence[jax.Device] | None = None) -> RoleMeshes:
    """Assigns ``devices`` (default ``jax.devices()``) to the roles of ``plan`` and builds their meshes."""
    devices = list(jax.devices() if devices is None else devices)
    if len(set(devices)) != len(devices):
        raise ValueError("build_meshes: the device list names a device twice")
    if plan.devices_needed > len(devices):
        raise ValueError(f"the role plan needs {plan.devices_needed} devices (rollout={plan.rollout.devices}, "
                         f"teacher={plan.teacher.devices}, trainer={plan.trainer.devices}, "
                         f"colocated={plan.colocated}) but only {len(devices)} are available")
    if plan.colocated:
        shared = devices[:plan.trainer.devices]
        return RoleMeshes(role_mesh(shared, plan.rollout), role_mesh(shared, plan.teacher),
                          role_mesh(shared, plan.trainer), plan)
    meshes = {}
    start = 0
    for role in ROLES:
        spec: RoleSpec = getattr(plan, role)
        meshes[role] = role_mesh(devices[start:start + spec.devices], spec)
        start += spec.devices
    return RoleMeshes(plan=plan, **meshes)


def build_process_meshes(plan: RolePlan | None = None) -> RoleMeshes:
    """The meshes of this process in a multi-process run: ``plan`` (default ``RolePlan.for_device_count`` of the
    local devices) splits this process's devices as on one host; the teacher and rollout meshes are this process's
    own, and the trainer mesh takes the trainer devices of every process (the same local positions on each, the
    processes in order along the data axis), so one train step spans all processes. One process: ``build_meshes``."""
    if jax.process_count() == 1:
        return build_meshes(plan or RolePlan.for_device_count(len(jax.devices())))
    local = list(jax.local_devices())
    plan = plan or RolePlan.for_device_count(len(local))
    mine = build_meshes(plan, local)
    positions = [local.index(device) for device in mine.trainer.devices.flat]
    per_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        per_process.setdefault(device.process_index, []).append(device)
    if len({len(devices) for devices in per_process.values()}) != 1:
        raise ValueError("build_process_meshes: the processes have different numbers of devices "
                         f"({ {p: len(d) for p, d in sorted(per_process.items())} })")
    trainer_devices = [per_process[p][i] for p in sorted(per_process) for i in positions]
    trainer = role_mesh(trainer_devices, RoleSpec(len(trainer_devices), plan.trainer.tensor_parallel))
    return RoleMeshes(mine.rollout, mine.teacher, trainer, plan)


__all__ = ["ROLES", "MESH_AXES", "RoleSpec", "RolePlan", "RoleMeshes", "role_mesh", "build_meshes",
           "build_process_meshes"]
