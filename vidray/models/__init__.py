"""Model families (DiT + VAE + text encoder) built from diffusers/transformers components.

The names below come from `registry` on first use (PEP 562), so that `vidray.models.text_encoder` (what the
driver needs: tokenizer, caption checks) imports without diffusers (~3-5 s on 2 cores).
"""

__all__ = ["FAMILIES", "Components", "ModelFamily", "get_family"]


def __getattr__(name: str):
    if name in __all__:
        from vidray.models import registry  # heavy: torch, numpy, pydantic

        return getattr(registry, name)
    raise AttributeError(f"module 'vidray.models' has no attribute {name!r}")
