"""A benchmark figure that could not be measured is a miss with its reason, never an omission.

Every benchmark prints `{"benchmark": ..., "figures": {name: {"value", "unit", "goal"}}, ...}`; a figure it failed
to measure (a step that raised, a tool that is absent, a figure left out on the command line) stays in `figures`
as `{"value": null, "unit": ..., "goal": ..., "miss": "<reason>"}`, so a consumer that checks every goal sees it.
"""

from __future__ import annotations

from typing import Any


def miss(reason: str, *, unit: str, goal: str | None = None) -> dict[str, Any]:
    """A figure not measured: value None and `miss` the reason (one line)."""
    return {"value": None, "unit": unit, **({"goal": goal} if goal else {}), "miss": " ".join(reason.split())}


def fill_misses(figures: dict[str, Any], expected: dict[str, tuple[str, str | None]], reason: str) -> dict[str, Any]:
    """`figures` with each name of `expected` ({name: (unit, goal)}) that it lacks added as a miss for `reason`."""
    for name, (unit, goal) in expected.items():
        figures.setdefault(name, miss(reason, unit=unit, goal=goal))
    return figures
