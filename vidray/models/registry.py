"""Model families: what the trainer, sampler and exporter need to know about one DiT + VAE + text encoder stack.

```python
family = get_family(job.model.family)               # ValueError lists the valid names
components = family.build(job.model, seed=job.train.seed)  # the three role loaders, composed
model_pred = family.predict(components.transformer, noisy_latents, timesteps, prompt_embeds, prompt_attention_mask)
```
One file per family (`easyanimate.py`, `wan.py`, `cogvideox.py`, `animatediff.py`) implementing
`vidray.models.base.ModelFamily`, named by its card's `family_class` (`vidray.cards`); this module only builds them
(the families import `base`, never this module). A family's module is imported on first use of its name: every Ray
Train worker, encode stage actor and serve replica imports the registry, and importing all four families costs
each about 0.8 s of CPU more than importing the one it runs (measured on 2 cores: 6.3 s vs 5.5 s, most of both
being diffusers itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from vidray.cards import FamilyCard, FamilyCardError, all_cards, get_card
from vidray.logs import quiet_diffusers
from vidray.models.base import Components, Encoders, ModelFamily

__all__ = ["Components", "Encoders", "ModelFamily", "FAMILIES", "forget_family", "get_family"]


class _Families(Mapping):
    """{name: ModelFamily} over the registered cards (`vidray.cards.all_cards`), each family built (its
    module imported) on first access, then kept. Iterating or `len` imports nothing; `.values()` / `.items()`
    import every family."""

    def __init__(self) -> None:
        self._built: dict[str, ModelFamily] = {}

    def __getitem__(self, name: str) -> ModelFamily:
        if name not in self._built:
            try:
                card = get_card(name)
            except ValueError:
                raise KeyError(name) from None
            self._built[name] = _build(card)
            # Every process that loads a family's weights gets here first (workers, encode actors, serve replicas,
            # the validator): diffusers' "Loading pipeline components..." bars off in it (`vidray.logs`).
            quiet_diffusers()
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter([card.name for card in all_cards()])

    def __len__(self) -> int:
        return len(all_cards())

    def forget(self, name: str) -> None:
        self._built.pop(name, None)


def _build(card: FamilyCard) -> ModelFamily:
    """An instance of the card's `family_class`. Raises FamilyCardError (one line, naming the card and the field)
    when its module does not import, the class is missing or not a ModelFamily, its `name` differs from the
    card's, it leaves an abstract method unimplemented (a role loader: `load_condition_models`,
    `load_latent_models`, `load_diffusion_models`; `predict`, ...), or the card claims image-to-video and the
    class has no condition (does not override `ModelFamily.condition`)."""
    module, _, cls_name = card.family_class.partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError as err:
        raise FamilyCardError(f"family card {card.name!r}: family_class module {module!r} does not import: "
                              f"{err}") from None
    except AttributeError:
        raise FamilyCardError(f"family card {card.name!r}: family_class {card.family_class!r}: module {module} has "
                              f"no {cls_name}") from None
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
        raise FamilyCardError(f"family card {card.name!r}: family_class {card.family_class!r} is not a "
                              "vidray.models.base.ModelFamily subclass")
    if getattr(cls, "name", None) != card.name:
        raise FamilyCardError(f"family card {card.name!r}: family_class {card.family_class!r} has name "
                              f"{getattr(cls, 'name', None)!r}; make them equal")
    if getattr(cls, "__abstractmethods__", None):
        raise FamilyCardError(f"family card {card.name!r}: {card.family_class} does not implement "
                              f"{', '.join(sorted(cls.__abstractmethods__))}: define them (the role loaders and the "
                              "rest of vidray.models.base.ModelFamily; docs/adding-a-family.md)")
    if card.image_to_video and cls.condition is ModelFamily.condition:
        i2v = [name for name, is_i2v in card.pipelines.items() if is_i2v]
        raise FamilyCardError(f"family card {card.name!r}: pipelines name image-to-video {', '.join(i2v)} but "
                              f"{card.family_class} has no condition (ModelFamily.condition); mark them False")
    return cls()


FAMILIES: Mapping[str, ModelFamily] = _Families()


def get_family(name: str) -> ModelFamily:
    """The registered family called `name` (its module imported on first use). Raises ValueError naming the valid
    families."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(sorted(FAMILIES))}") from None


def forget_family(name: str) -> None:
    """Drop the built family `name` from the cache (after `vidray.cards.unregister_card` in a test)."""
    FAMILIES.forget(name)
