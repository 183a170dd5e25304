"""Memory modes (issue 45), measured on CPU in one run: each helper's figures come from a `benchmarks/_memory_*.py`
module's `figures()`; this runner imports those present and prints `{"benchmark": "memory_modes", "figures": {...}}`
as its last stdout line.

    python benchmarks/memory_modes.py
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    torch_threads = 2
    import torch

    torch.set_num_threads(torch_threads)
    figures: dict = {}
    for path in sorted((REPO / "benchmarks").glob("_memory_*.py")):
        module = importlib.import_module(f"benchmarks.{path.stem}")
        figures.update(module.figures())
    print(json.dumps({"benchmark": "memory_modes", "figures": figures}))


if __name__ == "__main__":
    main()
