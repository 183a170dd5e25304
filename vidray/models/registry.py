"""Model families: what the trainer, sampler and exporter need to know about one DiT + VAE + text encoder stack.

```python
family = get_family(job.model.family)               # ValueError lists the valid names
components = family.build(job.model, seed=job.train.seed)
model_pred = family.predict(components.transformer, noisy_latents, timesteps, prompt_embeds, prompt_attention_mask)
```
One file per family (`easyanimate.py`, `wan.py`, `cogvideox.py`, `animatediff.py`) implementing `vidray.models.base.ModelFamily`; this module only
registers them (the families import `base`, never this module). A family's module is imported on first use of its
name: every Ray Train worker, encode stage actor and serve replica imports the registry, and importing all four
families costs each about 0.8 s of CPU more than importing the one it runs (measured on 2 cores: 6.3 s vs 5.5 s,
most of both being diffusers itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from vidray.logs import quiet_diffusers
from vidray.models.base import Components, Encoders, ModelFamily

__all__ = ["Components", "Encoders", "ModelFamily", "FAMILIES", "get_family"]

_REGISTRY: dict[str, str] = {
    "easyanimate": "vidray.models.easyanimate:EasyAnimateFamily",
    "wan": "vidray.models.wan:WanFamily",
    "cogvideox": "vidray.models.cogvideox:CogVideoXFamily",
    "animatediff": "vidray.models.animatediff:AnimateDiffFamily",
}
"""{family name: "module:class"}: the one line a new family adds."""


class _Families(Mapping):
    """{name: ModelFamily} over `_REGISTRY`, each family built (its module imported) on first access, then kept.
    Iterating or `len` imports nothing; `.values()` / `.items()` import every family."""

    def __init__(self, registry: dict[str, str]):
        self._registry = registry
        self._built: dict[str, ModelFamily] = {}

    def __getitem__(self, name: str) -> ModelFamily:
        if name not in self._built:
            module, cls = self._registry[name].split(":")  # KeyError for an unknown name, as a dict
            self._built[name] = getattr(importlib.import_module(module), cls)()
            # Every process that loads a family's weights gets here first (workers, encode actors, serve replicas,
            # the validator): diffusers' "Loading pipeline components..." bars off in it (`vidray.logs`).
            quiet_diffusers()
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)


FAMILIES: Mapping[str, ModelFamily] = _Families(_REGISTRY)


def get_family(name: str) -> ModelFamily:
    """The registered family called `name` (its module imported on first use). Raises ValueError naming the valid
    families."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(sorted(FAMILIES))}") from None
