"""The encoders' identities, remembered in the latent cache so that a run whose encoders are known starts no task.

A latent cache entry is named by the identity of the encoder that wrote it (`vidray.data.encode.module_identity`:
sha256 of the module's config and every weight). Finding it means building the encoder and hashing its weights: a
Ray task per stage that imports diffusers or transformers and loads the encoder, ~9 s of CPU each for the tiny
models on this project's 2-core machines (measured with `ps` during `vidray train`'s start-up, 2026-12-07), which
the workers starting beside them wait for. The identity only changes when what it hashes changes, so it is
remembered under `<latent_cache>/identities/<stage>-<key>.json`, where `<key>` is the sha256 of everything the
built encoder depends on (`memo_key`): the stage, the job's model section and `train.seed`, the size and mtime of
each file of a pretrained folder (`model_files_signature`), the versions of torch, diffusers and transformers, and
the source of the code that builds and hashes encoders (`vidray/models/*.py`, `vidray/data/encode.py`). Any change
to one of them is another key, so a stale identity is never read; an encode stage that builds its encoder checks the
remembered identity against the one it computes (`EncodeStage`), as it checks a task's.

Who writes it: the identity task, and every encode stage that builds its encoder (`vidray prepare --encode`
included), so the first `vidray train` after a prepare already starts no task.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib.metadata import version  # the installed versions, without importing the libraries
from pathlib import Path
from typing import Any

MEMO_FOLDER = "identities"
"""The folder under the latent cache root holding the remembered identities."""


def model_files_signature(model: dict[str, Any]) -> str:
    """(relative path, size, mtime_ns) of every file of the model section's pretrained folder and `vae_path`
    folder, as JSON ("" for random init without a vae_path): what changes when a user replaces the weights under
    the same path (e.g. `vidray train-vae` run again)."""
    folders = [model.get("pretrained_path") if model.get("init") == "pretrained" else None, model.get("vae_path")]
    files = [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
             for folder in folders if folder and Path(folder).is_dir()
             for f in sorted(Path(folder).rglob("*")) if f.is_file()]
    return json.dumps(files) if files else ""


@functools.lru_cache(maxsize=1)
def _code_signature() -> str:
    """sha256 of the libraries' versions and of the vidray source that builds and hashes encoders."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256("|".join(version(name) for name in ("torch", "diffusers", "transformers")).encode())
    for path in sorted([*(root / "models").glob("*.py"), root / "data" / "encode.py"]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def memo_key(stage: str, model: dict[str, Any], seed: int, files: str | None = None, storage: str = "fp32") -> str:
    """The name of a stage's remembered identity: `<stage>-<sha256 of its inputs>` (module docstring). `files`:
    `model_files_signature(model)` when the caller has it (computed here otherwise). `storage`: the encoders'
    storage dtype (`memory.storage_dtype` resolved for the stage: `fp32`, `bf16`, `fp8`); part of the key when not
    fp32 (bf16 / fp8 encoders write other latents), so fp32 keys are those of earlier runs."""
    files = model_files_signature(model) if files is None else files
    inputs = json.dumps({"stage": stage, "model": model, "seed": int(seed), "files": files,
                         "code": _code_signature(), **({"storage": storage} if storage != "fp32" else {})},
                        sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(inputs.encode()).hexdigest()[:40]}"


def read_identity(cache_root: str, key: str) -> str | None:
    """The identity remembered under `key` in the latent cache at `cache_root` (folder or URI), or None when there
    is none or it cannot be read (a damaged memo is computed again)."""
    from vidray.storage import open_storage  # heavy: pyarrow, numpy

    try:
        memo = json.loads(open_storage(cache_root, setting="data.latent_cache").read_bytes(f"{MEMO_FOLDER}/{key}.json"))
        identity = memo.get("identity")
        return identity if isinstance(identity, str) and len(identity) == 64 else None
    except Exception:  # noqa: BLE001 - absent, unreadable or not JSON: a miss
        return None


def write_identity(cache_root: str, key: str, identity: str) -> None:
    """Remember `identity` under `key` in the latent cache at `cache_root` (one small JSON file, written whole)."""
    from vidray.storage import open_storage  # heavy: pyarrow, numpy

    open_storage(cache_root, setting="data.latent_cache").write_bytes(
        f"{MEMO_FOLDER}/{key}.json", json.dumps({"identity": identity}).encode())


def identity_task(stage: str, model: dict[str, Any], seed: int, cache_root: str, key: str,
                  storage: str = "fp32") -> str:
    """A Ray task's body: the stage's identity (`vidray.data.encode.vae_identity` / `text_identity`, with the
    stage's storage dtype `storage`: `stored_identity`), remembered under `key` in the latent cache at `cache_root`
    (when given) for later runs. Raises what those raise."""
    from vidray.data.encode import stored_identity, text_identity, vae_identity  # heavy: numpy

    identity = stored_identity((vae_identity if stage == "vae" else text_identity)(model, seed), storage)
    if cache_root:
        write_identity(cache_root, key, identity)
    return identity
