"""What every benchmark writes: the JSON of a result and its markdown table beside it (``NAME.json``,
``NAME.md``), after printing the table; and the jitted train step the SFT benchmarks time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def write_result(result: Mapping[str, Any], table: str, out: str | Path) -> Path:
    """Print ``table``, write ``result`` as JSON to ``out`` and ``table`` to ``out`` with suffix ``.md``."""
    print()
    print(table)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return out


def sft_train_step(model: Any, loss_config: Any, *, learning_rate: float = 1e-4) -> tuple[Any, Any, Any]:
    """``(train_step, state, rows)``: the jitted AdamW step of ``loss_config`` on the trainer mesh of this host's
    devices, the fresh train state of ``model``, and the batch row sharding (``place_batch(batch, rows)``)."""
    import jax
    from flax import nnx

    from jaxopd.train.mesh import RolePlan, build_meshes
    from jaxopd.train.state import (OptimizerConfig, batch_shardings, init_train_state, make_optimizer,
                                    train_state_shardings)
    from jaxopd.train.step import make_train_step

    meshes = build_meshes(RolePlan.for_device_count(len(jax.devices())))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=learning_rate))
    shardings = train_state_shardings(params, optimizer, meshes.trainer)
    rows = batch_shardings(meshes.trainer)
    return (make_train_step(graphdef, optimizer, loss_config, shardings, rows),
            init_train_state(params, optimizer, shardings), rows)
