"""Issue 45's memory-mode figures, measured on CPU in one run: each helper's `benchmarks/_memory_<name>.py` module
present (`figures()` -> {name: {"value", "unit", "goal"}}, with optional details under `_details`) is run in turn
and its figures merged; a module whose run raised gives its figures as misses (`benchmarks/_figures.py`).

Run: .venv/bin/python benchmarks/memory_modes.py [--only export]   (about 15 minutes on 2 cores)

The last stdout line is one JSON object: {"benchmark": "memory_modes", "figures": {...}, "details": {...}}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _memory_* modules
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # vidray and `benchmarks._figures`

from _figures import fill_misses  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only these modules (_memory_<ONLY>.py); repeatable")
    args = parser.parse_args()
    names = sorted(p.stem[len("_memory_"):] for p in Path(__file__).resolve().parent.glob("_memory_*.py"))
    figures: dict = {}
    details: dict = {}
    for name in names:
        if args.only and name not in args.only:
            continue
        module = importlib.import_module(f"_memory_{name}")
        try:
            found = dict(module.figures())
        except Exception as err:  # noqa: BLE001 - a module that failed: its figures are misses with the reason
            traceback.print_exc()
            expected = getattr(module, "GOALS", None) or getattr(module, "EXPECTED", None) or {f"_memory_{name}": ("", None)}
            found = fill_misses({}, expected, f"{type(err).__name__}: {err}")
        details[name] = found.pop("_details", {})
        figures.update(found)
    print(json.dumps({"benchmark": "memory_modes", "figures": figures, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
