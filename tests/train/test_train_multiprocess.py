"""Multi-process training: two CPU processes (one device each, joined by jax.distributed over gloo) run the
sharded train step on a data axis that spans both, and match the same steps run single-process; plus the
cluster configuration, the per-process row split and the single-process forms of global_batch/host_params."""
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxopd.launch import free_port
from jaxopd.train import distributed
from jaxopd.train.buffer import Sample, collate_samples
from jaxopd.train.distributed import DistributedConfig, global_batch, host_params, process_local_rows
from jaxopd.train.state import batch_shardings, place_batch

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

WORKER = Path(__file__).resolve().parents[1] / "multiprocess_worker.py"
REPO = WORKER.parent.parent
PROCESS_TIMEOUT_S = 240


# ----------------------------------------------------------------------------------------------------------
# Two processes against one
# ----------------------------------------------------------------------------------------------------------
def worker_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXOPD_")}
    env.pop("XLA_FLAGS", None)          # conftest simulates 8 devices; each worker process has exactly one
    env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(num_processes: int, out: Path, logs: Path) -> None:
    """Runs ``num_processes`` workers to completion (killing all of them if one fails or they time out)."""
    coordinator = f"localhost:{free_port()}"
    procs, log_files = [], []
    try:
        for process_id in range(num_processes):
            log = open(logs / f"worker{num_processes}_{process_id}.log", "w")
            log_files.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--process-id", str(process_id), "--num-processes", str(num_processes),
                 "--coordinator", coordinator, "--out", str(out)],
                cwd=REPO, env=worker_env(), stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in log_files:
            log.close()
    codes = [p.returncode for p in procs]
    if codes != [0] * num_processes:
        tails = "\n".join(f"--- process {i} (rc {code}) ---\n"
                          + (logs / f"worker{num_processes}_{i}.log").read_text()[-4000:]
                          for i, code in enumerate(codes))
        pytest.fail(f"{num_processes}-process run failed or timed out after {PROCESS_TIMEOUT_S} s:\n{tails}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multiprocess")
    results = {}
    for name, count in (("two", 2), ("one", 1)):
        start = time.monotonic()
        launch(count, folder / f"{name}.json", folder)
        results[name] = json.loads((folder / f"{name}.json").read_text())
        results[name]["wall_s"] = time.monotonic() - start
    return results


@pytest.mark.timeout(300)
def test_two_process_train_steps_equal_single_process_steps(runs):
    one, two = runs["one"], runs["two"]
    assert (two["process_count"], two["device_count"], two["mesh_shape"]) == (2, 2, {"data": 2, "model": 1})
    assert (one["process_count"], one["device_count"], one["mesh_shape"]) == (1, 1, {"data": 1, "model": 1})
    assert two["local_rows"] == [0, 2] and one["local_rows"] == [0, 4]      # the primary's rows
    assert two["embedding_sharding"] == str(P(None, "data"))                # FSDP across the two processes
    assert one["step"] == two["step"] == 3
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two["grad_norms"], one["grad_norms"], rtol=1e-5)
    assert len(set(np.round(one["losses"], 4))) == 3       # the updates changed the policy step by step
    assert one["param_change"] > 1e-2                        # and the parameters moved well beyond the tolerance
    assert one["params"].keys() == two["params"].keys()
    for name in one["params"]:
        np.testing.assert_allclose(two["params"][name], one["params"][name], rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(two["param_sums"][name], one["param_sums"][name], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(two["param_norms"][name], one["param_norms"][name], rtol=1e-5)
    np.testing.assert_allclose(two["full_leaf"]["final_norm/scale"], one["full_leaf"]["final_norm/scale"], atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------
def test_config_from_env():
    assert DistributedConfig.from_env({}) is None
    assert DistributedConfig.from_env({"JAXOPD_COORDINATOR": " "}) is None
    env = {"JAXOPD_COORDINATOR": "host0:1234", "JAXOPD_NUM_PROCESSES": "4", "JAXOPD_PROCESS_ID": "3"}
    assert DistributedConfig.from_env(env) == DistributedConfig("host0:1234", 4, 3)
    assert DistributedConfig.from_env({**env, "JAXOPD_LOCAL_DEVICE_IDS": "0,1"}).local_device_ids == (0, 1)
    assert DistributedConfig.from_env({**env, "JAXOPD_HEARTBEAT_TIMEOUT": "12"}).heartbeat_timeout_s == 12
    with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive integer"):
        DistributedConfig.from_env({**env, "JAXOPD_HEARTBEAT_TIMEOUT": "0"})
    single = DistributedConfig.from_env({"JAXOPD_NUM_PROCESSES": "1", "JAXOPD_PROCESS_ID": "0"})
    assert single == DistributedConfig(None, 1, 0) and not single.is_multiprocess


@pytest.mark.parametrize("env, message", [
    ({"JAXOPD_COORDINATOR": "h:1"}, "JAXOPD_NUM_PROCESSES, JAXOPD_PROCESS_ID not"),
    ({"JAXOPD_NUM_PROCESSES": "2", "JAXOPD_COORDINATOR": "h:1"}, "JAXOPD_PROCESS_ID not"),
    ({"JAXOPD_COORDINATOR": "h:1", "JAXOPD_NUM_PROCESSES": "two", "JAXOPD_PROCESS_ID": "0"},
     "JAXOPD_NUM_PROCESSES must be an integer, got 'two'"),
    ({"JAXOPD_COORDINATOR": "h:1", "JAXOPD_NUM_PROCESSES": "2", "JAXOPD_PROCESS_ID": "2"},
     r"process_id must lie in \[0, num_processes=2\), got 2"),
    ({"JAXOPD_COORDINATOR": "h:1", "JAXOPD_NUM_PROCESSES": "0", "JAXOPD_PROCESS_ID": "0"},
     "num_processes must be >= 1, got 0"),
    ({"JAXOPD_NUM_PROCESSES": "2", "JAXOPD_PROCESS_ID": "0"}, "coordinator_address is required with num_processes=2"),
    ({"JAXOPD_COORDINATOR": "host0", "JAXOPD_NUM_PROCESSES": "2", "JAXOPD_PROCESS_ID": "0"},
     "coordinator_address must be 'host:port'"),
    ({"JAXOPD_COORDINATOR": "host0:99999", "JAXOPD_NUM_PROCESSES": "2", "JAXOPD_PROCESS_ID": "0"},
     "port in 1..65535"),
    ({"JAXOPD_COORDINATOR": "h:1", "JAXOPD_NUM_PROCESSES": "2", "JAXOPD_PROCESS_ID": "0",
      "JAXOPD_LOCAL_DEVICE_IDS": "0,x"}, "JAXOPD_LOCAL_DEVICE_IDS must be comma-separated integers"),
])
def test_config_from_env_rejects_bad_values_naming_the_field(env, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig.from_env(env)


def test_config_validates_fields():
    with pytest.raises(ValueError, match="local_device_ids must be distinct"):
        DistributedConfig("h:1", 2, 0, (0, 0))
    with pytest.raises(ValueError, match="process_id must be an integer"):
        DistributedConfig("h:1", 2, 0.5)
    with pytest.raises(ValueError, match="num_processes must be an integer"):
        DistributedConfig("h:1", True, 0)


def test_initialize_is_idempotent_and_skips_single_process(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "_initialized_with", None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    assert distributed.initialize(None) is False and distributed.initialize(DistributedConfig(None, 1, 0)) is False
    assert calls == []
    config = DistributedConfig("localhost:1234", 2, 1, (0,))
    assert distributed.initialize(config) is True and distributed.initialize(config) is True
    assert calls == [dict(coordinator_address="localhost:1234", num_processes=2, process_id=1, local_device_ids=[0],
                          heartbeat_timeout_seconds=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S)]
    with pytest.raises(ValueError, match="already initialised"):
        distributed.initialize(DistributedConfig("localhost:1234", 2, 0))


# ----------------------------------------------------------------------------------------------------------
# Rows, global batches and host parameters (one process, 8 simulated devices)
# ----------------------------------------------------------------------------------------------------------
def make_mesh(data, model):
    devices = np.asarray(jax.devices()[:data * model], dtype=object).reshape(data, model)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def test_process_local_rows_split_by_process_index(monkeypatch):
    assert process_local_rows(4) == slice(0, 4)
    assert process_local_rows(8, batch_shardings(make_mesh(4, 2)).tokens) == slice(0, 8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for index, expected in ((0, slice(0, 3)), (1, slice(3, 6))):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        assert process_local_rows(6) == expected
    with pytest.raises(ValueError, match="5 global rows do not split evenly over 2 processes"):
        process_local_rows(5)
    with pytest.raises(ValueError, match="positive integer"):
        process_local_rows(0)


def test_process_local_rows_of_a_sharding_checks_the_data_split():
    with pytest.raises(ValueError, match="6 rows cannot be split over the 4 data-parallel devices"):
        process_local_rows(6, batch_shardings(make_mesh(4, 2)).tokens)


def small_batch(rows, length=8):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(rows):
        n = int(rng.integers(3, length + 1))
        mask = np.arange(n) >= 1
        samples.append(Sample(rng.integers(0, 50, n), mask, np.where(mask, -rng.random(n), 0.0), i,
                              teacher_logp=-rng.random(n), teacher_generated=mask & (i % 2 == 0),
                              advantage=float(rng.normal()), retained=i != 1))
    return collate_samples(samples, length=length)


def test_global_batch_on_one_process_equals_place_batch():
    shardings = batch_shardings(make_mesh(4, 2))
    batch = small_batch(8)
    built, placed = global_batch(batch, shardings, 8), place_batch(batch, shardings)
    for field in dataclasses.fields(batch):
        a, b = getattr(built, field.name), getattr(placed, field.name)
        assert a.sharding == b.sharding == getattr(shardings, field.name), field.name
        assert a.dtype == b.dtype and a.shape == b.shape, field.name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field.name)
    with pytest.raises(ValueError, match=r"must supply rows \[0, 8\) = 8 rows of the 8-row batch"):
        global_batch(jax.tree.map(lambda x: x[:4], batch), shardings, 8)
    with pytest.raises(ValueError, match="6 rows cannot be split over the 4"):
        global_batch(jax.tree.map(lambda x: x[:6], batch), shardings, 6)


def test_host_params_on_one_process_are_the_full_values():
    mesh = make_mesh(4, 2)
    rng = np.random.default_rng(0)
    values = {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": np.arange(3, dtype=np.int32)}
    placed = {"w": jax.device_put(values["w"], jax.sharding.NamedSharding(mesh, P("data", "model"))),
              "b": jax.device_put(values["b"], jax.sharding.NamedSharding(mesh, P()))}
    out = host_params(placed)
    assert out.keys() == values.keys()
    for name, value in values.items():
        assert isinstance(out[name], np.ndarray) and out[name].dtype == value.dtype
        np.testing.assert_array_equal(out[name], value)
