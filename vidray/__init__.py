"""vidray: Ray-native training and serving of video diffusion models (DiT + VAE + text encoder)."""

from vidray.logs import apply_quiet_defaults as _apply_quiet_defaults
from vidray.runtime import apply_ray_env_defaults as _apply_ray_env_defaults

# Before anything imports ray: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import (see vidray.runtime); and
# before transformers, diffusers or Ray Data read their logging settings (see vidray.logs).
_apply_ray_env_defaults()
_apply_quiet_defaults()

__version__ = "0.1.0"
