"""LoRA adapters on a family's transformer (`model.lora`), with `peft`: apply, read/write the adapter weights,
merge, and the export format that stock tooling loads.

```python
transformer = apply_lora(transformer, job.model.lora, seed=job.train.seed)  # in place; only adapters train
state = adapter_state_dict(transformer)       # {"transformer_blocks.0.attn1.to_q.lora_A.weight": (r, in), ...}
load_adapter_state_dict(transformer, state)   # strict: exactly the model's adapter tensors
save_lora_weights(transformer, "<run>/diffusers/lora")   # diffusers + peft files (below)
load_lora_into(stock_transformer, "<run>/diffusers/lora")  # inject + load + merge: a plain module again
```

Each targeted `nn.Linear` W (out x in) becomes peft's `lora.Linear`: y = W x + (alpha / r) * B (A dropout(x)), A
(r x in) drawn from N(0, 1/r) (`init_lora_weights="gaussian"`, as diffusers' LoRA training scripts), B (out x r)
zero, so a freshly adapted model computes exactly what the base does. Parameter names gain `.base_layer` (the
frozen W, b) and `.lora_A.default` / `.lora_B.default`; the adapter's own names drop the adapter name
(`...to_q.lora_A.weight`), as `peft.get_peft_model_state_dict` and diffusers' `save_lora_weights` write them.

Export (`save_lora_weights`) writes, into one folder (`<run>/diffusers/lora/` for a LoRA run, `LORA_DIR`):
- `pytorch_lora_weights.safetensors`: diffusers' LoRA file: keys `transformer.<module>.lora_A.weight` /
  `.lora_B.weight`, the peft config as JSON in the safetensors metadata under `lora_adapter_metadata` (keys
  `transformer.r`, `transformer.lora_alpha`, ...): what `DiffusionPipeline.save_lora_weights(dir,
  transformer_lora_layers=get_peft_model_state_dict(transformer), transformer_lora_adapter_metadata=
  transformer.peft_config["default"].to_dict())` writes (diffusers 0.42.1 `loaders/lora_base.py`:
  `_save_lora_weights`, `write_lora_layers`; `training_utils._collate_lora_metadata`): the file a pipeline with a
  LoRA loader reads with `pipe.load_lora_weights(dir)` (`WanPipeline`'s `WanLoraLoaderMixin`; the tests read it
  with `WanLoraLoaderMixin.lora_state_dict(dir, return_lora_metadata=True)`).
- `adapter_config.json` + `adapter_model.safetensors` (keys `base_model.model.<module>.lora_A.weight`): peft's own
  format, what `PeftModel.save_pretrained` writes. diffusers 0.42.1's `EasyAnimatePipeline` has no LoRA loader
  (its transformer is not a `PeftAdapterMixin`), so a stock EasyAnimate pipeline takes the adapters through peft:

  ```python
  pipe = EasyAnimatePipeline.from_pretrained("<run>/diffusers")          # the base model
  PeftModel.from_pretrained(pipe.transformer, "<run>/diffusers/lora")    # injects into pipe.transformer in place
  video = pipe(prompt, ...)                                              # or .merge_and_unload() first
  ```

Under FSDP2 the adapter tensors are `DTensor`s: `adapter_state_dict` gathers each (`full_tensor`, a collective:
call it on every rank) and `load_adapter_state_dict` keeps each rank's shard; both are cheap (megabytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from vidray.errors import UserError
from vidray.models.formats import DIFFUSERS_LORA_WEIGHTS, LORA_DIR, PEFT_CONFIG, PEFT_WEIGHTS  # the file names

if TYPE_CHECKING:
    import peft

    from vidray.config import LoraConfig

__all__ = [
    "ADAPTER_NAME",
    "DIFFUSERS_LORA_WEIGHTS",
    "LORA_DIR",
    "LoraLoadError",
    "PEFT_CONFIG",
    "PEFT_WEIGHTS",
    "adapter_key",
    "adapter_state_dict",
    "apply_lora",
    "check_lora_targets",
    "has_lora",
    "init_adapters",
    "is_adapter_parameter",
    "load_adapter_state_dict",
    "load_lora_into",
    "lora_settings",
    "lora_summary",
    "lora_target_names",
    "merge_lora",
    "peft_lora_config",
    "read_lora_weights",
    "save_adapter_state",
    "save_lora_weights",
    "without_lora",
]

ADAPTER_NAME = "default"
"""peft's adapter name; vidray trains one adapter per transformer."""
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"
"""diffusers' `LORA_ADAPTER_METADATA_KEY`: the safetensors metadata entry holding the peft config as JSON."""
DIFFUSERS_PREFIX = "transformer."
"""diffusers' prefix of the transformer's LoRA keys (`TRANSFORMER_NAME` + '.')."""
PEFT_PREFIX = "base_model.model."
"""Key prefix in peft's `adapter_model.safetensors` (`PeftModel` wraps the model as base_model.model)."""
LORA_MODULE_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
"""Layer types peft's LoRA adapts (and so the names `model.lora.target_modules` may give)."""
_ADAPTER_KEY = re.compile(r"\.(lora_[A-Za-z_]+)\.(?:" + ADAPTER_NAME + r")(?=\.|$)")


class LoraLoadError(UserError):
    """A LoRA path that cannot be read or does not fit the transformer (named in the message)."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (`.module`) or `torch.compile` (`._orig_mod`); FSDP2 keeps the module itself."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def peft_lora_config(lora_cfg: "LoraConfig") -> "peft.LoraConfig":
    """`model.lora` -> `peft.LoraConfig(r=rank, lora_alpha=alpha or rank, lora_dropout=dropout,
    target_modules=[...], init_lora_weights="gaussian")`."""
    import peft  # heavy: torch, transformers, peft

    return peft.LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.lora_alpha, lora_dropout=lora_cfg.dropout,
                           target_modules=list(lora_cfg.target_modules), init_lora_weights="gaussian")


def lora_target_names(transformer: torch.nn.Module) -> list[str]:
    """The leaf names `model.lora.target_modules` may give for this transformer, sorted: the last part of each
    adaptable layer's name (`LORA_MODULE_TYPES`), or its last two where the last is an index (`to_out.0`,
    `net.2`). For EasyAnimate: add_k_proj, add_q_proj, add_v_proj, linear, linear_1, linear_2, net.2, proj,
    proj_out, text_proj, to_add_out, to_k, to_out.0, to_q, to_v."""
    names = set()
    for name, module in _unwrap(transformer).named_modules():
        if isinstance(module, LORA_MODULE_TYPES) and name:
            parts = name.split(".")
            names.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    return sorted(names)


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target_modules: the module's name is the target or ends in '.' + target."""
    return name == target or name.endswith("." + target)


def check_lora_targets(transformer: torch.nn.Module, lora_cfg: "LoraConfig") -> None:
    """Raise UserError naming `model.lora.target_modules` and listing `lora_target_names` when one of its names
    matches no adaptable layer (peft's rule: the layer's name is the target or ends in '.' + target). Reads module
    names and types only, so a model built on the meta device (no memory) does: what a driver-side check before any
    worker starts can use. `apply_lora` calls it first."""
    module = _unwrap(transformer)
    layer_names = [n for n, m in module.named_modules() if isinstance(m, LORA_MODULE_TYPES)]
    unknown = [t for t in lora_cfg.target_modules if not any(_matches(n, t) for n in layer_names)]
    if unknown:
        raise UserError(
            f"model.lora.target_modules: {', '.join(map(repr, unknown))} matches no layer of the "
            f"{type(module).__name__}; valid names: {', '.join(lora_target_names(module))} (default: to_q, to_k, "
            "to_v, to_out.0, the attention projections)"
        )


def has_lora(model: torch.nn.Module) -> bool:
    """True when `model` (plain, DDP or FSDP) holds peft adapter layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # heavy: torch, transformers, peft

    return any(isinstance(m, BaseTunerLayer) for m in _unwrap(model).modules())


def apply_lora(transformer: torch.nn.Module, lora_cfg: "LoraConfig", *, seed: int | None = None) -> torch.nn.Module:
    """Inject LoRA adapters into `transformer` in place (`peft.inject_adapter_in_model`) and freeze everything
    else: afterwards only the adapters' A (r x in) and B (out x r) have `requires_grad`, in the dtype and device of
    the layers they adapt. Returns `transformer` (the same object: its class, `config` and call are unchanged, so
    the family's `predict`, DDP and FSDP take it as before). B starts at zero, so the output equals the base's.

    seed: A is drawn under this seed in a forked RNG (the global torch RNG is left as it was), so every rank and
    every fresh run starts from the same adapters; None draws from the global RNG.

    Call it before the optimizer and the DDP/FSDP wrapper are built. Raises UserError naming
    `model.lora.target_modules` when a name matches no adaptable layer (listing `lora_target_names`), and
    ValueError when the transformer already has adapters.
    """
    import peft  # heavy: torch, transformers, peft

    module = _unwrap(transformer)
    if has_lora(module):
        raise ValueError("the transformer already has LoRA adapters: apply_lora once per model")
    check_lora_targets(module, lora_cfg)
    for param in module.parameters():
        param.requires_grad_(False)
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(peft_lora_config(lora_cfg), module, adapter_name=ADAPTER_NAME)
        except ValueError as err:  # e.g. a target that names a block, not a layer
            raise UserError(f"model.lora.target_modules {list(lora_cfg.target_modules)}: {err}; valid names: "
                            f"{', '.join(lora_target_names(module))}") from None
    for name, param in module.named_parameters():
        param.requires_grad_(_ADAPTER_KEY.search(name) is not None)
    return transformer


def lora_summary(transformer: torch.nn.Module) -> dict[str, int]:
    """{"trainable": adapter parameters with requires_grad, "adapter": all adapter parameters, "total": all
    parameters} (element counts), e.g. for the start-of-run line `trainable 49152 of 1.94 M parameters (2.5 %)`."""
    module = _unwrap(transformer)
    named = list(module.named_parameters())
    return {"trainable": sum(p.numel() for _, p in named if p.requires_grad),
            "adapter": sum(p.numel() for n, p in named if _ADAPTER_KEY.search(n)),
            "total": sum(p.numel() for _, p in named)}


def adapter_key(name: str) -> str:
    """`...to_q.lora_A.default.weight` -> `...to_q.lora_A.weight` (peft's saved naming)."""
    return _ADAPTER_KEY.sub(r".\1", name)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # heavy: torch

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def adapter_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors, copied (never views of the parameters), contiguous, on CPU, in their dtype: {"<module>.lora_A.weight":
    (r, in), "<module>.lora_B.weight": (out, r), ...}, named as `peft.get_peft_model_state_dict` names them
    (no adapter name, no DDP `module.` prefix). Every adapter tensor, trainable or frozen (a layer whose output the
    model never uses is frozen for DDP, `no_grad_parameter_names`: its B stays zero). Under FSDP each tensor is
    gathered (a collective: every rank must call). Raises ValueError when the model has no adapters."""
    module = _unwrap(transformer)
    state = {adapter_key(name): _full(param.detach()).to("cpu", copy=True).contiguous()
             for name, param in module.named_parameters() if _ADAPTER_KEY.search(name)}
    if not state:
        raise ValueError("the transformer has no LoRA adapters (apply_lora first)")
    return state


def is_adapter_parameter(name: str) -> bool:
    """True for the name of an adapter tensor (`...to_q.lora_A.default.weight`), False for a base one."""
    return _ADAPTER_KEY.search(name) is not None


def init_adapters(transformer: torch.nn.Module, *, seed: int) -> None:
    """Give the adapters of a transformer built on the meta device (then sharded and materialised with
    `to_empty`, `vidray.train.parallel.load_sharded_from_safetensors`) their starting values, which `apply_lora`
    could not draw on the meta device: each A (r x in) from N(0, 1/r^2) (peft's `init_lora_weights="gaussian"`), each
    B zero, so the model computes what its base does. A is drawn in name order from one generator seeded with
    `seed`, so every rank draws the same full tensor and keeps its shard (`load_adapter_state_dict`: a collective
    under FSDP); the values differ from what `apply_lora` draws on a materialised model (peft's own RNG order),
    not in distribution. Raises ValueError when the model has no adapters."""
    module = _unwrap(transformer)
    shapes = {adapter_key(n): tuple(p.shape) for n, p in module.named_parameters() if is_adapter_parameter(n)}
    if not shapes:
        raise ValueError("the transformer has no LoRA adapters to initialise (apply_lora first)")
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if ".lora_A." in key:
            state[key] = torch.randn(shape, generator=generator) / shape[0]  # std 1/r: r is A's first dimension
        else:
            state[key] = torch.zeros(shape)
    load_adapter_state_dict(transformer, state)


def load_adapter_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (`adapter_state_dict`'s naming and shapes) into the model's adapters in place, every one:
    the keys must be exactly the model's adapter tensors, with the same shapes (values are cast to each
    parameter's dtype and device; under FSDP each rank keeps its shard). Raises ValueError naming the missing,
    unexpected or mis-shaped keys (a few of each) when they do not fit (another rank or target_modules)."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # heavy: torch

    module = _unwrap(transformer)
    params = {adapter_key(n): p for n, p in module.named_parameters() if _ADAPTER_KEY.search(n)}
    if not params:
        raise ValueError("the transformer has no LoRA adapters to load into (apply_lora first)")
    missing = sorted(params.keys() - state.keys())
    unexpected = sorted(state.keys() - params.keys())
    shapes = sorted(k for k in params.keys() & state.keys() if tuple(params[k].shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        problems = []
        for what, keys in (("missing", missing), ("unexpected", unexpected)):
            if keys:
                problems.append(f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
        if shapes:
            k = shapes[0]
            problems.append(f"{len(shapes)} of another shape ({k}: {tuple(state[k].shape)} saved, "
                            f"{tuple(params[k].shape)} in the model)")
        raise ValueError(f"the adapter weights do not fit this model's adapters: {'; '.join(problems)}")
    with torch.no_grad():
        for key, param in params.items():
            value = state[key].to(dtype=param.dtype)
            if isinstance(param, DTensor):
                param.to_local().copy_(distribute_tensor(value.to(param.device), param.device_mesh,
                                                         param.placements).to_local())
            else:
                param.copy_(value.to(param.device))


def _lora_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer  # heavy: torch, transformers, peft

    return [(n, m) for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)]


def _set_submodule(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


@torch.no_grad()
def merge_lora(transformer: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its layer's weight (W <- W + (alpha / r) B A, peft's `merge`) and put the plain
    layer back in place of peft's wrapper: afterwards `transformer` holds no adapters, its state dict has the
    base model's keys, and it computes what the adapted model did (to float rounding). Returns `transformer`
    (same object). Not for FSDP-sharded models (gather first). Raises ValueError when it has no adapters."""
    module = _unwrap(transformer)
    if not _lora_layers(module):
        raise ValueError("the transformer has no LoRA adapters to merge")
    _remove_adapters(module, merge=True)
    return transformer


def _remove_adapters(module: torch.nn.Module, *, merge: bool) -> None:
    """Put each peft layer's base layer back in its place, after folding the adapter into it when `merge`."""
    for name, layer in _lora_layers(module):
        if merge:
            layer.merge(adapter_names=[ADAPTER_NAME])
        _set_submodule(module, name, layer.get_base_layer())
    module.__dict__.pop("peft_config", None)


@contextlib.contextmanager
def without_lora(transformer: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, `transformer` is its base model: each peft layer is swapped for its base layer (the same
    weight tensors, nothing copied or merged), so `save_pretrained` writes the stock model's keys. Restored on
    exit, even on error. A model without adapters is yielded as it is."""
    module = _unwrap(transformer)
    layers = _lora_layers(module)
    config = module.__dict__.pop("peft_config", None)
    try:
        for name, layer in layers:
            _set_submodule(module, name, layer.get_base_layer())
        yield transformer
    finally:
        for name, layer in layers:
            _set_submodule(module, name, layer)
        if config is not None:
            module.peft_config = config


def _config_of(module: torch.nn.Module) -> "peft.LoraConfig":
    config = getattr(module, "peft_config", {}).get(ADAPTER_NAME)
    if config is None:
        raise ValueError("the transformer has no LoRA adapters (apply_lora first)")
    return config


def lora_settings(transformer: torch.nn.Module) -> dict[str, Any]:
    """The adapters' shape in `model.lora`'s terms, {"rank", "alpha", "dropout", "target_modules" (sorted)}, as a
    checkpoint's manifest records it. Raises ValueError when the model has no adapters."""
    config = _config_of(_unwrap(transformer))
    return {"rank": int(config.r), "alpha": float(config.lora_alpha), "dropout": float(config.lora_dropout),
            "target_modules": sorted(config.target_modules)}


def _config_json(config: "peft.LoraConfig") -> dict[str, Any]:
    """A peft config as plain JSON values (sets as sorted lists), as diffusers and peft write it."""
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def save_lora_weights(transformer: torch.nn.Module, out_dir: str | Path, *, prefix: str = "") -> Path:
    """Write the transformer's adapters into `out_dir` (created) in both formats of the module docstring:
    `pytorch_lora_weights.safetensors` (diffusers) and `adapter_config.json` + `adapter_model.safetensors`
    (peft). Tensors on CPU in the adapters' dtype (about 2 * r * (in + out) values per adapted layer). Returns
    `out_dir`.

    prefix: only the adapters of the submodule of that name, named as that module's own (`"transformer_2."`: the
    low-noise expert of a `TwoExperts` whose adapters were applied to both, `vidray.models.experts`), so each
    expert's folder is the file of one stock transformer (diffusers loads the low-noise one's with
    `pipe.load_lora_weights(folder, load_into_transformer_2=True)`). Raises ValueError when the model (or the
    prefixed submodule) has no adapters."""
    module = _unwrap(transformer)
    state = adapter_state_dict(module)
    base = module
    if prefix:
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise ValueError(f"the transformer has no LoRA adapters under {prefix!r}")
        base = module.get_submodule(prefix.rstrip("."))
    return _write_lora_files(state, _config_of(module), type(base), out_dir)


def _plain_class(cls: type) -> type:
    """`cls` without FSDP2's wrapper class (`fully_shard` makes `FSDP<Class>`): the model's own class."""
    return next((c for c in cls.__mro__ if not c.__name__.startswith("FSDP")), cls)


def save_adapter_state(state: dict[str, torch.Tensor], lora_cfg: "LoraConfig", base_class: type,
                       out_dir: str | Path) -> Path:
    """`save_lora_weights` from the adapter tensors alone (`adapter_state_dict`'s naming, `...to_q.lora_A.weight`)
    and the run's `model.lora`, with no model in memory: what the end of a sharded LoRA run writes after gathering
    only the adapters. `base_class`: the adapted transformer's class (peft's `auto_mapping`; an FSDP2 wrapper class
    is unwrapped). Returns `out_dir`. Raises ValueError for an empty `state`."""
    if not state:
        raise ValueError("no LoRA adapter tensors to save")
    return _write_lora_files(state, peft_lora_config(lora_cfg), base_class, out_dir)


def _write_lora_files(state: dict[str, torch.Tensor], peft_config: "peft.LoraConfig", base_class: type,
                      out_dir: str | Path) -> Path:
    """The two formats of the module docstring in `out_dir`: diffusers' file with the config in its metadata, and
    peft's adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file  # heavy: safetensors

    base_class = _plain_class(base_class)
    config = _config_json(peft_config)
    config["inference_mode"] = True
    config["auto_mapping"] = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", DIFFUSERS_METADATA_KEY: json.dumps(
        {f"{DIFFUSERS_PREFIX}{k}": v for k, v in config.items()}, indent=2, sort_keys=True)}
    save_file({DIFFUSERS_PREFIX + k: v for k, v in state.items()}, str(out_dir / DIFFUSERS_LORA_WEIGHTS),
              metadata=metadata)
    save_file({PEFT_PREFIX + k: v for k, v in state.items()}, str(out_dir / PEFT_WEIGHTS), metadata={"format": "pt"})
    (out_dir / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _lora_config_from(kwargs: dict[str, Any], where: str) -> "peft.LoraConfig":
    import peft  # heavy: torch, transformers, peft

    known = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
    try:
        return peft.LoraConfig(**{k: v for k, v in kwargs.items() if k in known})
    except (TypeError, ValueError) as err:
        raise LoraLoadError(f"LoRA {where}: its adapter config cannot be read ({err})") from None


def read_lora_weights(path: str | Path) -> tuple["peft.LoraConfig", dict[str, torch.Tensor]]:
    """The adapter config and tensors of a LoRA path: a folder holding `pytorch_lora_weights.safetensors`
    (diffusers, preferred) or `adapter_config.json` + `adapter_model.safetensors` (peft), or either .safetensors
    file itself. Keys come back in `adapter_state_dict`'s naming (the `transformer.` / `base_model.model.` prefix
    removed); the config from the diffusers metadata or adapter_config.json, else (a diffusers file without
    metadata) r from the lora_A shapes and lora_alpha = r. Raises LoraLoadError naming the path and what is
    wrong."""
    from safetensors import safe_open  # heavy: safetensors

    path = Path(path)
    if not path.exists():
        raise LoraLoadError(f"LoRA {path} does not exist; give a folder written by vidray's export "
                            f"(<run>/diffusers/{LORA_DIR}) or a {DIFFUSERS_LORA_WEIGHTS}")
    if path.is_dir():
        for name in (DIFFUSERS_LORA_WEIGHTS, PEFT_WEIGHTS):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise LoraLoadError(f"LoRA folder {path} holds neither {DIFFUSERS_LORA_WEIGHTS} (diffusers) nor "
                                f"{PEFT_WEIGHTS} (peft); give the folder vidray's export writes "
                                f"(<run>/diffusers/{LORA_DIR})")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            raw = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a bad file
        raise LoraLoadError(f"LoRA {path} is not a readable safetensors file ({type(err).__name__}: {err})") from None
    prefix = PEFT_PREFIX if path.name == PEFT_WEIGHTS else DIFFUSERS_PREFIX
    others = sorted(k for k in raw if not k.startswith(prefix))
    if others:
        raise LoraLoadError(f"LoRA {path}: {len(others)} keys are not the transformer's (e.g. {others[0]!r}; "
                            f"expected the prefix {prefix!r}): only transformer adapters are supported")
    state = {k[len(prefix):]: v for k, v in raw.items()}
    if not state or not all(".lora_" in k for k in state):
        raise LoraLoadError(f"LoRA {path} holds no LoRA tensors (keys ending in .lora_A.weight / .lora_B.weight)")
    if path.name == PEFT_WEIGHTS:
        config_path = path.parent / PEFT_CONFIG
        if not config_path.is_file():
            raise LoraLoadError(f"LoRA {path}: {PEFT_CONFIG} is missing beside it")
        try:
            kwargs = json.loads(config_path.read_text())
        except (OSError, ValueError) as err:
            raise LoraLoadError(f"LoRA {config_path} cannot be read ({err})") from None
        return _lora_config_from(kwargs, str(config_path)), state
    if DIFFUSERS_METADATA_KEY in metadata:
        packed = json.loads(metadata[DIFFUSERS_METADATA_KEY])
        kwargs = {k[len(DIFFUSERS_PREFIX):]: v for k, v in packed.items() if k.startswith(DIFFUSERS_PREFIX)}
        return _lora_config_from(kwargs, str(path)), state
    ranks = {v.shape[0] for k, v in state.items() if ".lora_A." in k}
    if len(ranks) != 1:
        raise LoraLoadError(f"LoRA {path} has no {DIFFUSERS_METADATA_KEY} metadata and its adapters have several "
                            f"ranks {sorted(ranks)}: re-save it with its adapter config")
    targets = sorted({k.split(".lora_")[0] for k in state})
    rank = ranks.pop()
    return _lora_config_from({"r": rank, "lora_alpha": rank, "target_modules": targets}, str(path)), state


def load_lora_into(transformer: torch.nn.Module, path: str | Path, *, merge: bool = True) -> torch.nn.Module:
    """Load the LoRA at `path` (`read_lora_weights`' formats) into `transformer`, in place: inject the adapters its
    config describes, copy its tensors, then (merge=True) fold them into the weights (`merge_lora`), leaving a
    plain transformer that samples as the adapted one. What `vidray generate --lora` and the serve config's
    `lora_path` do before sampling. Returns `transformer`. Raises LoraLoadError naming `path` when it cannot be
    read or does not fit the transformer (another model, rank or targets)."""
    import peft  # heavy: torch, transformers, peft

    config, state = read_lora_weights(path)
    module = _unwrap(transformer)
    if has_lora(module):
        raise LoraLoadError(f"LoRA {path}: the transformer already has unmerged adapters; merge them first")
    try:
        peft.inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
    except ValueError as err:
        raise LoraLoadError(f"LoRA {path} targets modules that this {type(module).__name__} lacks ({err})") from None
    try:
        load_adapter_state_dict(module, state)
    except ValueError as err:
        _remove_adapters(module, merge=False)  # the transformer is left as it was
        raise LoraLoadError(f"LoRA {path} does not fit this {type(module).__name__}: {err}") from None
    for param in module.parameters():
        param.requires_grad_(False)
    return merge_lora(transformer) if merge else transformer
