"""Bounded number types for the job config: the range of a setting written in its type, where pydantic checks it
(`Annotated[..., Field(ge=..., gt=..., lt=...)]`), instead of a hand-written `if ...: raise ValueError` per key.

```python
fps: Annotated[PositiveFloat, Says("frames/s")] = 8.0
```

A value out of range reads, in one line (`bound_message`, called by `vidray.config`'s error formatter):
`data.fps must be > 0 frames/s, got 0`. `Says` carries the words around the bound; pydantic ignores it. Checks that
involve two settings stay model validators in `vidray.config`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Annotated, Any

from pydantic import Field
from pydantic.fields import FieldInfo

__all__ = ["AtLeastOne", "BOUND_ERRORS", "Fraction", "NonNegativeFloat", "NonNegativeInt", "OpenFraction",
           "PositiveFloat", "Says", "bound_message", "bounded_type_text"]

AtLeastOne = Annotated[int, Field(ge=1)]
"""An int >= 1 (a count of steps, samples, workers)."""
NonNegativeInt = Annotated[int, Field(ge=0)]
"""An int >= 0 (0 usually turns the feature off)."""
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A finite float > 0."""
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A finite float >= 0."""
Fraction = Annotated[float, Field(ge=0, lt=1)]
"""A float in [0, 1): a probability or a decay rate that must leave something."""
OpenFraction = Annotated[float, Field(gt=0, lt=1)]
"""A float in (0, 1)."""

BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"})
"""pydantic error types a bound above raises; `bound_message` words them."""


@dataclasses.dataclass(frozen=True)
class Says:
    """The words a bound's error adds: `unit` after the bound (`"frames/s"`, `"(0 turns it off)"`), `note` after
    the value (`" (default 1.0)"`, `": Ray Data with no CPU never runs its operators"`). Annotated metadata that
    pydantic ignores."""

    unit: str = ""
    note: str = ""


def _constraints(hint: Any) -> tuple[dict[str, Any], Says, bool, Any]:
    """The bounds (`gt`, `ge`, `lt`, `le`), the `Says`, whether None is allowed and the number type, of a field's
    type hint (read with `include_extras=True`)."""
    bounds: dict[str, Any] = {}
    says = Says()
    nullable = False
    base: Any = None
    stack = [hint]
    while stack:
        current = stack.pop()
        args = typing.get_args(current)
        if current in (int, float):
            base = current
        if typing.get_origin(current) is Annotated:
            stack.append(args[0])
            for meta in current.__metadata__:
                if isinstance(meta, Says):
                    says = meta
                items = meta.metadata if isinstance(meta, FieldInfo) else [meta]
                for item in items:
                    for key in ("gt", "ge", "lt", "le"):
                        if getattr(item, key, None) is not None:
                            bounds[key] = getattr(item, key)
        elif typing.get_origin(current) in (typing.Union, types.UnionType):
            nullable = nullable or type(None) in args
            stack.extend(a for a in args if a is not type(None))
    return bounds, says, nullable, base


def _range_text(bounds: dict[str, Any]) -> str:
    lower = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
    upper = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
    if lower and upper:
        return f"in {lower[0]}{lower[1]}, {upper[1]}{upper[0]}"
    if lower:
        return f"{'>' if lower[0] == '(' else '>='} {lower[1]}"
    if upper:
        return f"{'<' if upper[0] == ')' else '<='} {upper[1]}"
    return "a finite number"


def bound_message(key: str, hint: Any, value: Any) -> str:
    """One line for a value of setting `key` (dotted) out of the range its type `hint` gives, e.g.
    `bound_message("data.fps", hint, 0)` -> "data.fps must be > 0 frames/s, got 0"."""
    bounds, says, nullable, _ = _constraints(hint)
    infinite = isinstance(value, float) and not math.isfinite(value)
    return (f"{key} must be {_range_text(bounds)}{' or null' if nullable else ''}{' ' + says.unit if says.unit else ''}"
            f", got {value}{' (not a finite number)' if infinite else ''}{says.note}")


def bounded_type_text(hint: Any) -> str | None:
    """A bounded setting's type as the configuration reference shows it, e.g. `int >= 1`, `float in [0, 1) | None`;
    None for a hint without bounds (the reference then shows the annotation as written)."""
    bounds, _, nullable, base = _constraints(hint)
    if not bounds or base is None:
        return None
    return f"{base.__name__} {_range_text(bounds)}{' | None' if nullable else ''}"
