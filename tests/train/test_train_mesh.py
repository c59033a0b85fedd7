"""Role plans and the rollout / teacher / trainer meshes over the 8 simulated CPU devices."""
import jax
import pytest

from jaxopd.train.mesh import RolePlan, RoleSpec, build_meshes


def test_paper_plan_places_roles_on_disjoint_devices():
    devices = jax.devices()
    assert len(devices) == 8
    meshes = build_meshes(RolePlan.disjoint(4, 2, 2))
    rollout, teacher, trainer = (meshes.devices_of(r) for r in ("rollout", "teacher", "trainer"))
    assert rollout == set(devices[:4]) and teacher == set(devices[4:6]) and trainer == set(devices[6:])
    assert not (rollout & teacher) and not (rollout & trainer) and not (teacher & trainer)
    assert dict(meshes.rollout.shape) == {"data": 4, "model": 1}
    assert dict(meshes.trainer.shape) == {"data": 2, "model": 1}
    assert RolePlan.for_device_count(8) == RolePlan.disjoint(4, 2, 2)
    assert RolePlan.for_device_count(16) == RolePlan.disjoint(8, 4, 4)


def test_tensor_parallel_roles_get_a_model_axis():
    meshes = build_meshes(RolePlan.disjoint(2, 2, 4, teacher_tensor_parallel=2, trainer_tensor_parallel=2))
    assert dict(meshes.teacher.shape) == {"data": 1, "model": 2}
    assert dict(meshes.trainer.shape) == {"data": 2, "model": 2}
    assert meshes.trainer.devices.tolist() == [jax.devices()[4:6], jax.devices()[6:8]]


def test_one_device_is_shared_by_every_role():
    plan = RolePlan.for_device_count(1)
    assert plan.colocated
    meshes = build_meshes(plan, jax.devices()[:1])
    assert meshes.devices_of("rollout") == meshes.devices_of("teacher") == meshes.devices_of("trainer") \
        == {jax.devices()[0]}
    assert RolePlan.for_device_count(6) == RolePlan.colocated_on(6)


def test_invalid_plans_raise_value_errors():
    with pytest.raises(ValueError, match="needs 10 devices .* only 8 are available"):
        build_meshes(RolePlan.disjoint(4, 4, 2))
    with pytest.raises(ValueError, match="needs 3 devices .* only 2"):
        build_meshes(RolePlan.disjoint(1, 1, 1), jax.devices()[:2])
    with pytest.raises(ValueError, match="tensor_parallel=2 does not divide devices=3"):
        RoleSpec(3, 2)
    with pytest.raises(ValueError, match="positive integer"):
        RoleSpec(0)
    with pytest.raises(ValueError, match="device counts must be equal"):
        RolePlan(RoleSpec(2), RoleSpec(1), RoleSpec(1), colocated=True)
    with pytest.raises(ValueError, match="names a device twice"):
        build_meshes(RolePlan.colocated_on(2), [jax.devices()[0]] * 2)
    with pytest.raises(ValueError, match="unknown role"):
        build_meshes(RolePlan.colocated_on(1)).devices_of("critic")
