"""What every benchmark writes: the JSON of a result and its markdown table beside it (``NAME.json``,
``NAME.md``), after printing the table."""
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
