"""Helpers every family's export and load share: a diffusers pipeline folder written atomically, the check that a
`pretrained_path` is a local diffusers folder (hub ids are never resolved), and the probe for transformer
parameters that get no gradient. Family quirks stay in the family files; this module names no family.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from vidray.config import ModelConfig

__all__ = ["pretrained_folder", "require_pipeline_folder", "unused_parameter_names", "write_pipeline_folder"]


def pretrained_folder(model_cfg: "ModelConfig", family: str, presets: tuple[str, ...] = ("tiny",)) -> Path | None:
    """`model.pretrained_path` for `init: pretrained`, None for `init: random` (after checking `model.preset` is
    one of the `family`'s `presets`). Raises ValueError for an unknown init or preset, or an empty path."""
    if model_cfg.init == "pretrained":
        if not model_cfg.pretrained_path:
            raise ValueError("model.init is 'pretrained' but model.pretrained_path is empty")
        return Path(model_cfg.pretrained_path)
    if model_cfg.init != "random":
        raise ValueError(f"unknown model.init {model_cfg.init!r}; valid: random, pretrained")
    if model_cfg.preset not in presets:
        raise ValueError(f"unknown {family} preset {model_cfg.preset!r}; valid: {', '.join(presets)}")
    return None


def require_pipeline_folder(path: str | Path, pipeline_class: str, components: tuple[str, ...] = ()) -> Path:
    """`path` as a Path when it holds a `model_index.json` (and, when `components` are named, a `<pipeline_class>`
    whose every component subfolder is there). Raises FileNotFoundError naming the folder and the fix (a folder
    written by vidray's export or `<pipeline_class>.save_pretrained`; hub ids are not downloaded), or ValueError
    naming the other pipeline class the folder holds (another family's folder)."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"pretrained_path {str(path)!r} is not a local diffusers folder (no model_index.json); give a folder "
            f"written by `vidray` export or `{pipeline_class}.save_pretrained` (hub ids are not downloaded)"
        )
    if not components:
        return path
    try:
        class_name = json.loads((path / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"pretrained_path {str(path)!r}: model_index.json is not readable JSON ({err})") from None
    if class_name != pipeline_class:
        raise ValueError(f"pretrained_path {str(path)!r} holds a {class_name} pipeline, not a {pipeline_class}: set "
                         f"model.family to the folder's family or give a {pipeline_class} folder")
    missing = [name for name in components if not (path / name).is_dir()]
    if missing:
        raise FileNotFoundError(f"pretrained_path {str(path)!r} lacks {', '.join(f'{m}/' for m in missing)}: the "
                                f"{pipeline_class} folder is incomplete; re-export it or copy the missing component")
    return path


def write_pipeline_folder(pipe: Any, out_dir: str | Path) -> Path:
    """`pipe.save_pretrained(out_dir, safe_serialization=True)`, written to a temp folder next to `out_dir` and
    then renamed, so `out_dir` is complete or absent; an existing pipeline folder at `out_dir` is replaced. Raises
    FileExistsError if `out_dir` exists and is not an empty folder or a pipeline folder. Returns `out_dir`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / "model_index.json").is_file():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists and is not a diffusers pipeline folder; choose an empty path")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it 0700; the exported model is meant to be shared
    try:
        pipe.save_pretrained(tmp_dir, safe_serialization=True)
        if not (tmp_dir / "model_index.json").is_file():
            raise RuntimeError(f"save_pretrained wrote no model_index.json in {tmp_dir}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def unused_parameter_names(transformer: torch.nn.Module,
                           probe_loss: Callable[[torch.nn.Module, torch.nn.Module], torch.Tensor]) -> list[str]:
    """Names of `transformer`'s trainable parameters that receive no gradient from `probe_loss(transformer,
    transformer)` (a scalar): `torch.autograd.grad` with `allow_unused=True`, so `.grad` fields are not touched.
    What DDP needs frozen (`requires_grad_(False)`) to avoid "Expected to have finished reduction"."""
    params = [(name, p) for name, p in transformer.named_parameters() if p.requires_grad]
    if not params:
        return []
    with torch.enable_grad():
        grads = torch.autograd.grad(probe_loss(transformer, transformer), [q for _, q in params], allow_unused=True)
    return [name for (name, _), grad in zip(params, grads) if grad is None]


def unwrapped(module: "torch.nn.Module") -> "torch.nn.Module":
    """The model inside a DDP wrapper (its `.module`), else `module` itself: what a family reads `config` and
    other attributes from, since the training loop hands `predict` the DDP-wrapped transformer (FSDP2 wraps in
    place and needs no unwrapping)."""
    return getattr(module, "module", module)


def meta_component(path: str | Path, name: str) -> tuple["torch.nn.Module", str]:
    """(the component `name` of the pipeline folder `path` built on the meta device from its config alone: shapes,
    no weights; the folder of its weights), its class read from the folder's model_index.json (diffusers or
    transformers). Raises FileNotFoundError naming the folder when the index or the component's config is missing."""
    path = Path(path)
    entry = json.loads((path / "model_index.json").read_text()).get(name) if (path / "model_index.json").is_file() \
        else None
    folder = path / name
    if not entry or entry[0] is None or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"pretrained_path {str(path)!r} has no {name}/ config (model_index.json and "
                                f"{name}/config.json): give a complete diffusers pipeline folder")
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    if entry[0] != "transformers":
        return meta_module(cls, folder)
    with torch.device("meta"):
        module = cls._from_config(cls.config_class.from_pretrained(str(folder)))
    return module, str(folder)


def folder_component(cls: type, path: str | Path, name: str, *, meta: bool) -> tuple["torch.nn.Module", str | None]:
    """The diffusers component `name` (class `cls`) of the local pipeline folder `path`: with its weights, offline,
    and None for its weights folder; or, `meta`, `meta_component`'s build from its config alone and the folder of its
    weights. What a role loader's folder branch reads (`ModelFamily.load_latent_models`'s `vae/`). Raises as
    `meta_component` or `from_pretrained` do for a folder without the component."""
    if meta:
        return meta_component(path, name)
    return cls.from_pretrained(path, subfolder=name, local_files_only=True), None


def meta_module(cls: type, folder: str | Path) -> tuple["torch.nn.Module", str]:
    """(the diffusers model class `cls` built on the meta device from `folder`'s config.json alone: shapes, no
    weights; `folder`), e.g. a `model.vae_path` VAE folder. Raises FileNotFoundError naming the folder when it has
    no config.json."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a diffusers model folder (no config.json): give the vae/ "
                                "folder of a diffusers pipeline or one `vidray train-vae` wrote")
    with torch.device("meta"):
        module = cls.from_config(cls.load_config(str(folder)))
    return module, str(folder)
