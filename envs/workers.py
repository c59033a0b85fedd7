"""What every worker process of ``envs`` does when it starts (the environment pool's and the game generator's).

Owns ``worker_init``: Ctrl-C is left to the parent (which closes its pool), and a thread exits the worker as soon as
it is re-parented, so that a parent killed outright (SIGKILL, the OOM killer) leaves no worker burning CPU or
holding a JVM. (``PR_SET_PDEATHSIG`` is not used: it fires when the parent *thread* that started the worker ends,
and pool threads are short-lived.)
"""
from __future__ import annotations

import os
import signal
import threading
import time

PARENT_POLL_S = 0.5


def worker_init(parent: int | None = None) -> None:
    """The initializer of a worker process: ignore SIGINT, exit within ``PARENT_POLL_S`` once the parent is gone.

    ``parent``: the pid of the process that started the pool (pass ``os.getpid()`` in ``initargs``): a parent that
    died while the worker was still starting is then noticed too (the worker's own ``getppid()`` would already be
    its new parent's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid() if parent is None else parent
    if os.getppid() != parent:
        os._exit(1)

    def watch_parent() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch_parent, name="worker-parent-watch", daemon=True).start()


__all__ = ["PARENT_POLL_S", "worker_init"]
