"""``import_alfworld``: the one way the text environments (package ``jaxopd_envs``, folder ``envs/``) import the
alfworld wheel: alfworld's own ``info`` module sets ``$ALFWORLD_DATA`` to ``~/.cache/alfworld`` on import when it is
unset, after which every reader of the variable (``jaxopd.methods.benchmarks``, ``jaxopd_envs.alfworld``) would take
that empty cache for the user's official games.
"""
from __future__ import annotations

import os
import sys

ALFWORLD_DATA_ENV = "ALFWORLD_DATA"


def import_alfworld() -> None:
    """Import the alfworld package (once per process) and leave ``$ALFWORLD_DATA`` as it was before."""
    if "alfworld" in sys.modules:
        return
    before = os.environ.get(ALFWORLD_DATA_ENV)
    try:
        import alfworld  # noqa: F401  (alfworld/__init__ runs alfworld.info, which writes the variable)
    finally:
        if before is None:
            os.environ.pop(ALFWORLD_DATA_ENV, None)
        else:
            os.environ[ALFWORLD_DATA_ENV] = before
