"""Exponential moving average of the trained transformer's weights (`train.ema`).

ema <- decay * ema + (1 - decay) * weights every `update_every_steps` optimizer steps, with torch's
`torch.optim.swa_utils.AveragedModel` and `get_ema_multi_avg_fn` (one `torch._foreach_lerp_` over all parameters).
The first update copies the weights (AveragedModel's `n_averaged == 0` rule), so what the average held before it
never matters.

Only the parameters that train are averaged (a frozen one's average is itself): a LoRA run's EMA is its adapters,
megabytes where a copy of a 14 B transformer would be 56 GB. Rank 0 alone keeps it under DDP: the replicas'
weights are equal, and rank 0 writes the checkpoint and the export. A full checkpoint holds it as `ema.safetensors`
(keys `module.params.<parameter name with "." as "__">` and `n_averaged`).

Under FSDP/HSDP every rank keeps the average of its own shards: the parameters are `DTensor`s, the average's copies
are too (same mesh and placements), and `torch._foreach_lerp_` updates each shard locally, with no communication.
A sharded checkpoint holds it in its DCP folder under `ema.` (`vidray.train.checkpoint`); the export gathers it
(`full_averages`, a collective).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from vidray.config import EMAConfig
from vidray.models.export import sharded_entries


class TrainableParameters(torch.nn.Module):
    """The parameters that require grad of a module, by name, as a module of their own (sharing the tensors):
    what `AveragedModel` copies and averages. `names`: the parameters' names in the source module."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        # Activation-checkpoint wrappers (`every_<n>`) insert `_checkpoint_wrapped_module.` into the names: the EMA
        # keeps the model's own names, made before or after the wrapping alike.
        named = [(name.replace("_checkpoint_wrapped_module.", ""), param)
                 for name, param in module.named_parameters() if param.requires_grad]
        self.names = [name for name, _ in named]
        # ParameterDict sorts a plain dict's keys: AveragedModel pairs averages and weights by that same order.
        self.params = torch.nn.ParameterDict({name.replace(".", "__"): param for name, param in named})


class EMA:
    """The EMA of `transformer`'s trainable parameters.

    Args:
        transformer: the trained module, unwrapped (not DDP), with its final set of trainable parameters (after
            LoRA and the freezing of parameters that get no gradient); activation-checkpoint wrappers may come
            before or later (they keep the parameter objects); under FSDP, after `fully_shard` (which replaces
            the parameters with sharded ones).
        config: `train.ema`.
    """

    def __init__(self, transformer: torch.nn.Module, config: EMAConfig):
        self.config = config
        self._live = TrainableParameters(transformer)  # the trained tensors themselves, never copied
        self.averaged = AveragedModel(self._live, multi_avg_fn=get_ema_multi_avg_fn(config.decay), use_buffers=False)
        self.averaged.requires_grad_(False)

    @property
    def num_updates(self) -> int:
        """Updates applied so far (0: none; the next one copies the weights)."""
        return int(self.averaged.n_averaged.item())

    def averages(self) -> dict[str, torch.Tensor]:
        """{parameter name in the transformer: its average} (the averaged tensors themselves; do not modify)."""
        averaged = self.averaged.module.params
        return {name: averaged[name.replace(".", "__")] for name in self._live.names}

    def full_averages(self) -> dict[str, torch.Tensor]:
        """{parameter name: its full average} on CPU, copied: for the export (`export.weights: ema`). A sharded
        (DTensor) average is gathered (`full_tensor`): a collective, so under FSDP every rank calls it, in the same
        order (the names' order is the same on every rank)."""
        out = {}
        for name, average in self.averages().items():
            full = average.full_tensor() if hasattr(average, "full_tensor") else average
            out[name] = full.detach().to("cpu", copy=True)
        return out

    def maybe_update(self, step: int) -> bool:
        """Average the trained parameters in when `step` (1-based optimizer step just applied) is a multiple of
        `update_every_steps`; returns whether it did."""
        if step % self.config.update_every_steps:
            return False
        self.averaged.update_parameters(self._live)
        return True

    def reset(self) -> None:
        """Start the average afresh from the current weights (an EMA added on resume, or a checkpoint written
        without one)."""
        averaged = self.averaged.module.params
        for key, param in self._live.params.items():
            averaged[key].detach().copy_(param.detach())
        self.averaged.n_averaged.zero_()

    def copy_to(self, transformer: torch.nn.Module) -> None:
        """`copy_averages_to(transformer, self.full_averages())` (a collective under FSDP)."""
        copy_averages_to(transformer, self.full_averages())


def copy_averages_to(transformer: torch.nn.Module, averages: dict[str, torch.Tensor]) -> None:
    """Write `averages` ({parameter name: full average}, `EMA.full_averages`) into `transformer`'s parameters of
    the same names (the export at the end of training, `export.weights: ema`). Raises KeyError naming a parameter
    the transformer lacks."""
    _copy_into_parameters(transformer, averages, "the EMA")


def _copy_into_parameters(transformer: torch.nn.Module, averages: dict[str, torch.Tensor], source: str) -> None:
    """Copy {parameter name: tensor} into `transformer`'s parameters of those names. Raises KeyError naming a
    name the transformer has no parameter of (`source` says whose)."""
    # Activation-checkpoint wrappers (`every_<n>`) insert `_checkpoint_wrapped_module.` into the names.
    params = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in transformer.named_parameters()}
    with torch.no_grad():
        for name, average in averages.items():
            if name not in params:
                raise KeyError(f"{source} holds {name}, which the transformer has no parameter of")
            params[name].copy_(average)


def load_ema_into(transformer: torch.nn.Module, checkpoint_dir: str | Path) -> bool:
    """Copy a local checkpoint folder's EMA (`ema.safetensors`, written from `EMA.averaged`; in a sharded checkpoint
    the DCP folder's `ema` entries, every rank's shards joined) into `transformer`'s parameters of the same names
    (what validation samples). Returns False, changing nothing, when the checkpoint holds no EMA. Raises KeyError
    naming an averaged parameter the transformer lacks."""
    from safetensors.torch import load_file  # heavy: safetensors

    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / "ema.safetensors"
    manifest = checkpoint_dir / "manifest.json"
    if path.is_file():
        saved = load_file(str(path))
    elif manifest.is_file() and json.loads(manifest.read_text()).get("ema"):  # sharded (FSDP)
        saved = sharded_entries(checkpoint_dir, "ema")
    else:
        return False
    averages = {key.removeprefix("module.params.").replace("__", "."): value
                for key, value in saved.items() if key != "n_averaged"}
    _copy_into_parameters(transformer, averages, "the checkpoint's EMA")
    return True
