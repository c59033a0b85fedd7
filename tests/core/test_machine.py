"""jaxopd.machine: the machine record every result writes, read from /proc-like files written here."""
from __future__ import annotations

import importlib.metadata

from jaxopd import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse4_1 sse4_2 avx f16c avx2 fma avx512f avx512_bf16 bmi2 aes

processor\t: 1
model name\t: another model the first processor's record hides
flags\t\t: fpu amx_tile
"""


def test_cpu_model_and_features_come_from_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert machine.cpu_model(path) == "AMD EPYC 9R14"
    assert machine.cpu_features(path) == ["avx", "avx2", "avx512_bf16", "avx512f", "f16c", "fma", "sse4_1",
                                          "sse4_2"]
    missing = tmp_path / "none"
    assert machine.cpu_features(missing) == []
    assert machine.cpu_model(missing)                              # platform's processor or architecture


def test_machine_info_records_versions_without_starting_jax():
    info = machine.machine_info(devices=False)
    assert info["packages"]["jax"] == importlib.metadata.version("jax") == info["jax"]
    assert info["packages"]["numpy"] == importlib.metadata.version("numpy")
    assert info["cpu_count"] >= 1 and "backend" not in info
    assert machine.package_versions(("jax", "no-such-distribution-here")) == {
        "jax": importlib.metadata.version("jax"), "no-such-distribution-here": None}
    full = machine.machine_info()
    assert full["backend"] == "cpu" and full["num_devices"] == len(full["devices"]) >= 1


def test_same_numerics_compares_cpu_features_and_packages():
    a = {"cpu": "AMD EPYC", "cpu_features": ["avx", "avx2", "avx512f"], "packages": {"jax": "0.10.2"}}
    assert machine.same_numerics(a, dict(a)) is True
    assert machine.same_numerics(a, {**a, "cpu_features": ["avx", "avx2"]}) is False     # no AVX-512
    assert machine.same_numerics(a, {**a, "packages": {"jax": "0.10.1"}}) is False
    assert machine.same_numerics(a, {**a, "platform": "another kernel build"}) is True
    assert machine.same_numerics({**a, "backend": "cpu"}, {**a, "backend": "gpu"}) is False
    assert machine.same_numerics(a, {"cpu": "AMD EPYC"}) is None                         # an older record
    full = {**a, "platform": "x", "cpu_count": 2, "backend": "cpu"}
    assert machine.numerics(full) == a and machine.same_numerics(machine.numerics(full), full) is True
