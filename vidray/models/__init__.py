"""Model families (DiT + VAE + text encoder) built from diffusers/transformers components.

`registry` is imported first: it defines the shared interface and then registers the families.
"""

from vidray.models.registry import FAMILIES, Components, ModelFamily, get_family

__all__ = ["FAMILIES", "Components", "ModelFamily", "get_family"]
