"""Local multi-process launch: N copies of one command line as the processes of one JAX cluster on this machine.

Owns ``launch_local``: it picks a free coordinator port, starts the N children with ``JAXOPD_COORDINATOR``,
``JAXOPD_NUM_PROCESSES`` and ``JAXOPD_PROCESS_ID`` (read by ``jaxopd.train.distributed.DistributedConfig.from_env``)
and CPU collectives, forwards SIGINT / SIGTERM to all of them (each writes its part of the checkpoint and stops), and
watches them: when one dies (a signal or a non-zero exit) while others still run, it stops the others within
``grace_s`` seconds and says which process was lost. It exists for tests and for trying a multi-process run on one
machine; on a cluster each host starts its own process with those variables (docs/multiprocess.md).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence

from jaxopd.train.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch_local(command: Sequence[str], num_processes: int, *, grace_s: float = 30.0,
                 env: dict[str, str] | None = None, log: Callable[[str], None] | None = None,
                 poll_s: float = 0.2) -> int:
    """Runs ``command`` as ``num_processes`` processes of one cluster; returns 0 when all exit 0, else the first
    failure's code (128 + signal for a signal). ``log`` (default: standard error) gets one line per lost process."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"the number of processes must be a positive integer, got {num_processes!r}")
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    base = dict(os.environ if env is None else env)
    base.setdefault("JAX_PLATFORMS", "cpu")
    base[ENV_COORDINATOR] = f"localhost:{free_port()}"
    base[ENV_NUM_PROCESSES] = str(num_processes)
    children: list[subprocess.Popen] = []
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for process in range(num_processes):
            children.append(subprocess.Popen(list(command), env={**base, ENV_PROCESS_ID: str(process)}))
        first_failure: tuple[int, int] | None = None
        while any(child.poll() is None for child in children):
            for index, child in enumerate(children):
                code = child.poll()
                if code not in (None, 0) and first_failure is None:
                    first_failure = (index, code)
                    if not forwarded:
                        say(f"process {index} of {num_processes} was lost ({describe_exit(code)}); stopping the "
                            "others")
                        _stop(children, grace_s)
            time.sleep(poll_s)
        codes = [child.returncode for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if first_failure is None:
        bad = next((code for code in codes if code != 0), 0)
    else:
        bad = first_failure[1]
    return 0 if bad == 0 else (128 - bad if bad < 0 else bad)


def _stop(children: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to the children still running, SIGKILL to those still running ``grace_s`` later."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(child.poll() is None for child in children):
        time.sleep(0.1)
    for child in children:
        if child.poll() is None:
            child.kill()


__all__ = ["describe_exit", "free_port", "launch_local"]
