"""Issue 45's memory-mode figures, measured on CPU in one run: each helper's `benchmarks/_memory_<name>.py` module
present in this checkout contributes its `figures()` ({name: {value, unit, goal}}); a module that raises leaves
its figures as misses with the reason (`benchmarks/_figures.py`).

Run: .venv/bin/python benchmarks/memory_modes.py     (no Ray; a few minutes on 2 cores)
The last stdout line is `{"benchmark": "memory_modes", "figures": {...}}`.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    import torch

    torch.set_num_threads(1)  # small steps; two threads on a shared 2-core machine ran them 10x slower
    sys.path.insert(0, str(HERE))
    figures: dict = {}
    for path in sorted(HERE.glob("_memory_*.py")):
        name = path.stem
        try:
            figures.update(importlib.import_module(name).figures())
        except Exception as err:  # a helper's failure is a miss, the others still run
            figures[f"{name}_failed"] = {"value": None, "unit": "", "miss": f"{type(err).__name__}: {err}"}
    print(json.dumps({"benchmark": "memory_modes", "figures": figures}))


if __name__ == "__main__":
    main()
