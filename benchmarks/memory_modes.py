"""Issue 45: the memory modes' figures, measured on CPU in one run (a thin runner; the owner unifies it on merge).

Each helper's figures live in its own `benchmarks/_memory_<name>.py`, whose `figures()` returns
`{NAME: {"value", "unit", "goal", ...}}`; this runner imports every such module present, in name order, and prints
`{"benchmark": "memory_modes", "figures": {...}}` as the last stdout line. A module that raises leaves its figures
as misses with the reason (`_figures.miss`), never an omission (its expected names: its `EXPECTED`, when it has one,
else one miss named after the module).

    .venv/bin/python benchmarks/memory_modes.py      # ~3 min per module on 2 cores
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _figures import miss  # noqa: E402


def main() -> None:
    figures: dict = {}
    for path in sorted(HERE.glob("_memory_*.py")):
        name = path.stem
        try:
            module = importlib.import_module(name)
            figures.update(module.figures())
        except Exception as err:  # noqa: BLE001 - a module that fails is a miss, the others still count
            traceback.print_exc()
            expected = getattr(sys.modules.get(name), "EXPECTED", None) or {name: ("", None)}
            for figure, (unit, goal) in expected.items():
                figures[figure] = miss(f"{name}: {type(err).__name__}: {err}", unit=unit, goal=goal)
    print(json.dumps({"benchmark": "memory_modes", "figures": figures}))


if __name__ == "__main__":
    main()
