"""Where a job writes, checked before anything is reserved: an output folder or object-store URI that can be
written (`check_output_location`) and the latent cache a job resolves to (`latent_cache_root`). Used by the trainer's
driver checks, `vidray doctor` and the encode stage (`vidray.data.fill_cache.encode_cache_root`)."""

from __future__ import annotations

from pathlib import Path

from vidray.config import JobConfig, check_output_path
from vidray.locations import absolute_location, is_uri
from vidray.storage import open_storage

__all__ = ["check_output_location", "latent_cache_root"]


def check_output_location(key: str, location: str) -> None:
    """Refuse an output location that cannot be written, naming `key`: a local folder (or `file://` URI) by
    `vidray.config.check_output_path`; an object-store URI by `Storage.check_reachable(write=True)` (the endpoint
    answers, the bucket exists, a probe object can be written). Raises ConfigError / UserError."""
    storage = open_storage(location, setting=key) if is_uri(location) else None
    if storage is not None and not storage.is_local:
        storage.check_reachable(key, write=True)
    else:  # a path, or a file:// URI
        check_output_path(storage.base if storage is not None else location, key)


def latent_cache_root(job: JobConfig) -> str:
    """The latent cache of a job (`data.latent_cache`, `vidray.data.encode`): "" when `off`, `<shards_dir>/latents`
    when `auto`, else the folder (absolute) or URI given."""
    setting = str(job.data.latent_cache).strip()
    if setting == "off":
        return ""
    if setting == "auto":
        shards = absolute_location(job.data.shards_dir)
        return f"{shards.rstrip('/')}/latents" if is_uri(shards) else str(Path(shards) / "latents")
    return absolute_location(setting)
