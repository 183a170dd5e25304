"""What every section of the job config shares: the strict frozen pydantic config of a section, the one
`ConfigError`, and the small checks more than one section makes."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict

from vidray.cards import all_cards
from vidray.errors import UserError


_STRICT = ConfigDict(extra="forbid", frozen=True)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


class ConfigError(UserError):
    """A job config that cannot run: unknown key, wrong type, bad choice or inconsistent values."""



def _families_with(capability: str) -> str:
    """The registered families whose card has `capability` (a truthy field or property, e.g. `blocks`,
    `image_to_video`), sorted and comma-separated."""
    return ", ".join(sorted(card.name for card in all_cards() if getattr(card, capability)))


def _number_not_boolean(key: str, value: Any) -> Any:
    """`value`, unless it is a boolean given for the number `key` of a nested section (`model.lora`, `model.i2v`,
    `model.experts`, which `_scalar_type_errors` does not walk): pydantic's lax mode would read `true` as 1.
    Raises ValueError naming the key."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: {str(value).lower()} is a boolean, not a number")
    return value
