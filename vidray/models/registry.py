"""Model families: what the trainer, sampler and exporter need to know about one DiT + VAE + text encoder stack.

```python
family = get_family(job.model.family)               # ValueError lists the valid names
components = family.build(job.model, seed=job.train.seed)
model_pred = family.predict(components.transformer, noisy_latents, timesteps, prompt_embeds, prompt_attention_mask)
```
One file per family (`easyanimate.py`, `wan.py`, `cogvideox.py`, `animatediff.py`) implementing `vidray.models.base.ModelFamily`; this module only
registers them (it imports the families; the families import `base`, never this module).
"""

from __future__ import annotations

from vidray.models.base import Components, Encoders, ModelFamily

__all__ = ["Components", "Encoders", "ModelFamily", "FAMILIES", "get_family"]


def _families() -> dict[str, ModelFamily]:
    from vidray.models.animatediff import AnimateDiffFamily
    from vidray.models.cogvideox import CogVideoXFamily
    from vidray.models.easyanimate import EasyAnimateFamily
    from vidray.models.wan import WanFamily

    return {"easyanimate": EasyAnimateFamily(), "wan": WanFamily(), "cogvideox": CogVideoXFamily(),
            "animatediff": AnimateDiffFamily()}


FAMILIES: dict[str, ModelFamily] = _families()


def get_family(name: str) -> ModelFamily:
    """The registered family called `name`. Raises ValueError naming the valid families."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(sorted(FAMILIES))}") from None
