"""Multi-process (multi-controller) training: joining the JAX cluster and building global arrays.

Owns the cluster configuration (``DistributedConfig``, read from ``JAXOPD_*`` environment variables) and
the single call to ``jax.distributed.initialize``; which rows of a global batch each process contributes
and the assembly of a global ``TrainBatch`` from every process's own rows
(``jax.make_array_from_process_local_data``); and gathering the full parameter values to host memory on
every process, for the weight sync of a process-local rollout engine.

In a multi-process run every process executes the same program: it calls :func:`initialize` before any
other JAX call, builds the meshes over ``jax.devices()`` (every process's devices), loads only its own
rows of each batch and passes them to :func:`global_batch`; the jitted train step then runs over all
processes. With one process every function here reduces to its single-process counterpart.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxopd.train.buffer import TrainBatch
from jaxopd.train.state import check_rows_divide

ENV_COORDINATOR = "JAXOPD_COORDINATOR"
ENV_NUM_PROCESSES = "JAXOPD_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXOPD_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXOPD_LOCAL_DEVICE_IDS"
"""Optional: comma-separated ids of the local devices this process uses (e.g. ``0,1``)."""
ENV_HEARTBEAT_TIMEOUT = "JAXOPD_HEARTBEAT_TIMEOUT"
"""Optional: seconds without a heartbeat after which JAX's coordinator declares a process lost and the others stop
(default ``DEFAULT_HEARTBEAT_TIMEOUT_S``; JAX's own default is 100)."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 30


# ----------------------------------------------------------------------------------------------------------
# Configuration and initialisation
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in the cluster.

    coordinator_address: ``host:port`` of process 0's coordinator service (required with more than one
      process; every process passes the same address).
    num_processes: how many processes take part (>= 1).
    process_id: this process's index, ``0 <= process_id < num_processes``; process 0 is the primary.
    local_device_ids: optional ids of the local devices this process drives (None: all of them).
    heartbeat_timeout_s: seconds without a heartbeat before the coordinator declares a process lost and the other
      processes stop with an error naming it.
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

    def __post_init__(self):
        for name in ("num_processes", "process_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"DistributedConfig.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.num_processes < 1:
            raise ValueError(f"DistributedConfig.num_processes must be >= 1, got {self.num_processes}")
        if isinstance(self.heartbeat_timeout_s, bool) or not isinstance(self.heartbeat_timeout_s, int) \
                or self.heartbeat_timeout_s < 1:
            raise ValueError(f"DistributedConfig.heartbeat_timeout_s must be a positive integer, got "
                             f"{self.heartbeat_timeout_s!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"DistributedConfig.process_id must lie in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id}")
        if self.coordinator_address is not None:
            _check_address(self.coordinator_address)
        elif self.num_processes > 1:
            raise ValueError(f"DistributedConfig.coordinator_address is required with num_processes="
                             f"{self.num_processes} (e.g. 'host0:12345')")
        if self.local_device_ids is not None:
            ids = tuple(self.local_device_ids)
            if (not ids or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids)
                    or len(set(ids)) != len(ids)):
                raise ValueError("DistributedConfig.local_device_ids must be distinct non-negative integers "
                                 f"(or None), got {self.local_device_ids!r}")
            object.__setattr__(self, "local_device_ids", tuple(int(i) for i in ids))

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DistributedConfig | None":
        """The config from ``JAXOPD_COORDINATOR``, ``JAXOPD_NUM_PROCESSES``, ``JAXOPD_PROCESS_ID`` (and the
        optional ``JAXOPD_LOCAL_DEVICE_IDS``); None when none of the three is set. ``environ`` defaults to
        ``os.environ``."""
        environ = os.environ if environ is None else environ
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        present = [name for name in names if environ.get(name, "").strip()]
        if not present:
            return None
        if ENV_NUM_PROCESSES not in present or ENV_PROCESS_ID not in present:
            missing = [name for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if name not in present]
            raise ValueError(f"distributed environment incomplete: {', '.join(present)} set but "
                             f"{', '.join(missing)} not")

        def integer(name: str) -> int:
            text = environ[name].strip()
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {text!r}") from None

        local_ids = environ.get(ENV_LOCAL_DEVICE_IDS, "").strip()
        if local_ids:
            try:
                parsed_ids: tuple[int, ...] | None = tuple(int(part) for part in local_ids.split(","))
            except ValueError:
                raise ValueError(f"{ENV_LOCAL_DEVICE_IDS} must be comma-separated integers, got {local_ids!r}") \
                    from None
        else:
            parsed_ids = None
        coordinator = environ.get(ENV_COORDINATOR, "").strip() or None
        heartbeat = integer(ENV_HEARTBEAT_TIMEOUT) if environ.get(ENV_HEARTBEAT_TIMEOUT, "").strip() else \
            DEFAULT_HEARTBEAT_TIMEOUT_S
        return cls(coordinator, integer(ENV_NUM_PROCESSES), integer(ENV_PROCESS_ID), parsed_ids, heartbeat)


def _check_address(address: Any) -> None:
    if not isinstance(address, str) or address.count(":") < 1:
        raise ValueError(f"DistributedConfig.coordinator_address must be 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"DistributedConfig.coordinator_address must be 'host:port' with a port in 1..65535, "
                         f"got {address!r}")


_initialized_with: DistributedConfig | None = None


def initialize(config: DistributedConfig | None) -> bool:
    """Joins the cluster of ``config`` with ``jax.distributed.initialize``; call it before any other JAX call.

    Idempotent: a second call with the same config does nothing, one with a different config raises. With
    ``config=None`` or a single process nothing is initialised (plain single-process JAX). Returns whether
    this process runs multi-process. On CPU the cross-process collectives use JAX's
    ``jax_cpu_collectives_implementation`` (gloo by default in the JAX versions this project supports).
    """
    global _initialized_with
    if config is None or not config.is_multiprocess:
        return False
    if _initialized_with is not None:
        if _initialized_with != config:
            raise ValueError(f"jax.distributed is already initialised with {_initialized_with}; "
                             f"cannot re-initialise with {config}")
        return True
    if jax.distributed.is_initialized():
        raise ValueError("jax.distributed was initialised outside jaxopd.train.distributed.initialize; "
                         f"cannot initialise it again with {config}")
    jax.distributed.initialize(coordinator_address=config.coordinator_address,
                               num_processes=config.num_processes, process_id=config.process_id,
                               local_device_ids=(list(config.local_device_ids)
                                                 if config.local_device_ids is not None else None),
                               heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    _initialized_with = config
    return True


def heartbeat_timeout_s() -> int:
    """The heartbeat timeout this process joined the cluster with (``DEFAULT_HEARTBEAT_TIMEOUT_S`` before)."""
    return DEFAULT_HEARTBEAT_TIMEOUT_S if _initialized_with is None else _initialized_with.heartbeat_timeout_s


def is_primary() -> bool:
    """True on process 0 (the one that logs, writes checkpoints' metadata and results)."""
    return jax.process_index() == 0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


# ----------------------------------------------------------------------------------------------------------
# Host objects between processes
# ----------------------------------------------------------------------------------------------------------
def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (any picklable host object), in process order, on every process: pickled to bytes and
    all-gathered by JAX's own collectives (``multihost_utils.process_allgather``: first the lengths, then the bytes
    padded to the longest). Every process must call it at the same point. One process: ``[obj]``."""
    if not is_multiprocess():
        return [obj]
    import pickle

    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([payload.size], np.int64))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:payload.size] = payload
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [pickle.loads(gathered[i, :int(n)].tobytes()) for i, n in enumerate(lengths)]


def live_processes(timeout_s: float) -> list[int] | None:
    """The processes JAX's coordination service still counts as alive, after a failed collective: it answers once
    every live process has asked (a process that stopped sending heartbeats is dropped after the heartbeat timeout),
    so call it on every process that survived. ``None`` when no answer came within ``timeout_s`` seconds (a process
    still running but stuck elsewhere) or the coordinator itself is gone (process 0 hosts it)."""
    import threading

    from jax._src import distributed as jax_distributed       # the client has no public accessor in JAX 0.10

    client = jax_distributed.global_state.client
    if client is None:
        return None
    answer: list[list[int] | None] = [None]

    def ask() -> None:
        try:
            answer[0] = sorted(client.get_live_nodes(list(range(jax.process_count()))))
        except Exception:       # noqa: BLE001 - the coordinator is gone: no answer
            answer[0] = None

    thread = threading.Thread(target=ask, name="jaxopd-live-processes", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answer[0]


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a collective: every process calls it at the same point)."""
    return any(allgather_objects(bool(flag)))


# ----------------------------------------------------------------------------------------------------------
# Global batches
# ----------------------------------------------------------------------------------------------------------
def process_local_rows(global_rows: int, sharding: NamedSharding | None = None) -> slice:
    """The rows ``[start, stop)`` of a global batch of ``global_rows`` rows that this process contributes.

    Without ``sharding`` the rows are split evenly by process index (process ``p`` of ``P`` holds rows
    ``p * global_rows / P`` up to ``(p + 1) * global_rows / P``); that is the split of
    ``batch_shardings(mesh)`` on meshes built over ``jax.devices()``. With a ``sharding`` the rows are
    those this process's devices hold under it (all rows when the data axis does not cross processes).
    """
    if isinstance(global_rows, bool) or not isinstance(global_rows, (int, np.integer)) or global_rows < 1:
        raise ValueError(f"process_local_rows: global_rows must be a positive integer, got {global_rows!r}")
    global_rows = int(global_rows)
    if sharding is None:
        count, index = jax.process_count(), jax.process_index()
        if global_rows % count:
            raise ValueError(f"process_local_rows: {global_rows} global rows do not split evenly over {count} "
                             f"processes; use a multiple of {count}")
        per_process = global_rows // count
        return slice(index * per_process, (index + 1) * per_process)
    check_rows_divide(global_rows, sharding)
    row_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
    starts_stops = set()
    for device, index in row_sharding.devices_indices_map((global_rows,)).items():
        if device.process_index == jax.process_index():
            starts_stops.add(index[0].indices(global_rows)[:2])
    if not starts_stops:
        raise ValueError("process_local_rows: the sharding has no device of this process "
                         f"(process {jax.process_index()})")
    ordered = sorted(starts_stops)
    start, stop = ordered[0]
    for next_start, next_stop in ordered[1:]:
        if next_start > stop:
            raise ValueError(f"process_local_rows: this process's rows under the sharding are not contiguous "
                             f"({ordered}); build the mesh with each process's devices adjacent on the data axis")
        stop = max(stop, next_stop)
    return slice(start, stop)


def global_batch(local_batch: TrainBatch, shardings: TrainBatch, global_rows: int) -> TrainBatch:
    """The global ``TrainBatch`` of ``global_rows`` rows, placed on ``shardings``, assembled from each
    process's own rows ``local_batch`` (those of :func:`process_local_rows` under the batch sharding; host
    arrays, every process with the same padded length) with ``jax.make_array_from_process_local_data``.

    With one process the local batch is the whole batch and the result equals ``place_batch``.
    """
    expected = process_local_rows(global_rows, shardings.tokens)
    local_rows = expected.stop - expected.start
    out = {}
    for field in dataclasses.fields(TrainBatch):
        local = np.asarray(getattr(local_batch, field.name))
        sharding = getattr(shardings, field.name)
        if local.ndim < 1 or local.shape[0] != local_rows:
            raise ValueError(f"global_batch: process {jax.process_index()} must supply rows "
                             f"[{expected.start}, {expected.stop}) = {local_rows} rows of the {global_rows}-row "
                             f"batch, but its {field.name} has shape {local.shape}")
        check_rows_divide(global_rows, sharding)
        out[field.name] = jax.make_array_from_process_local_data(sharding, local,
                                                                 (global_rows,) + local.shape[1:])
    return TrainBatch(**out)


# ----------------------------------------------------------------------------------------------------------
# Parameters to the host
# ----------------------------------------------------------------------------------------------------------
def host_params(params: Any) -> Any:
    """The full value of every parameter as a host numpy array, on every process (a tree like ``params``).

    Arrays that span other processes' devices are gathered with one jitted all-gather per device set
    (the equivalent of ``multihost_utils.process_allgather(..., tiled=True)``, batched); arrays this
    process holds in full (single-process runs, replicated arrays) are copied directly. Every process must
    call it with the same tree (it runs collectives).
    """
    leaves, treedef = jax.tree.flatten(params)
    result: list[Any] = list(leaves)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            groups.setdefault(frozenset(leaf.sharding.device_set), []).append(i)
        else:
            result[i] = np.asarray(leaf)
    for indices in groups.values():
        arrays = [leaves[i] for i in indices]
        replicated = [_replicated_like(a.sharding) for a in arrays]
        gathered = jax.jit(lambda *xs: xs, out_shardings=tuple(replicated))(*arrays)
        for i, array in zip(indices, gathered):
            result[i] = np.asarray(array.addressable_data(0))
    return jax.tree.unflatten(treedef, result)


def _replicated_like(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    devices = sorted(sharding.device_set, key=lambda device: device.id)
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object), ("devices",))
    return NamedSharding(mesh, PartitionSpec(), memory_kind=sharding.memory_kind)


__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_LOCAL_DEVICE_IDS", "ENV_HEARTBEAT_TIMEOUT",
           "DistributedConfig", "initialize", "is_primary", "is_multiprocess", "allgather_objects", "any_process",
           "live_processes", "heartbeat_timeout_s",
           "process_local_rows", "global_batch", "host_params"]
