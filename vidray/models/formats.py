"""The names and errors of vidray's checkpoint and export folders that several model modules share: the LoRA
adapter folders and files (diffusers' and peft's names) and the checkpoint errors. A leaf: it imports nothing of
`vidray.models`, so `export`, `lora` and `dcp_reader` all read it without importing each other."""

from __future__ import annotations

from pathlib import Path

from vidray.errors import UserError

__all__ = ["CheckpointError", "DIFFUSERS_LORA_WEIGHTS", "DamagedCheckpointError", "EXPERT_LORA_DIRS",
           "IncompleteCheckpointError", "LORA_2_DIR", "LORA_DIR", "PEFT_CONFIG", "PEFT_WEIGHTS"]

LORA_DIR = "lora"
"""The folder beside an exported pipeline that holds a LoRA run's adapters (`vidray.models.lora`); of a two-expert
model's (`model.experts`), the high-noise expert's (diffusers' `transformer`)."""
LORA_2_DIR = "lora_2"
"""The folder beside a two-expert model's export that holds the low-noise expert's adapters (diffusers'
`transformer_2`: `pipe.load_lora_weights(folder, load_into_transformer_2=True)`)."""
EXPERT_LORA_DIRS = {"high": LORA_DIR, "low": LORA_2_DIR}
"""Each expert's adapters folder (`vidray.models.experts.EXPERTS`) in a two-expert LoRA run's export."""
DIFFUSERS_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""diffusers' LoRA weights file (`LORA_WEIGHT_NAME_SAFE`)."""
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter config and weights files (`PeftModel.save_pretrained`)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be trusted. `directory` is the folder; `part` the file at fault (or None)."""

    def __init__(self, message: str, directory: str | Path | None = None, part: str | None = None):
        super().__init__(message)
        self.directory = None if directory is None else str(directory)
        self.part = part

    def __reduce__(self):  # survives pickling from a Ray worker to the driver
        return (type(self), (str(self), self.directory, self.part))


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint folder lacks its manifest or one of its parts (an interrupted write)."""


class DamagedCheckpointError(CheckpointError):
    """A part's size or sha256 differs from what the manifest recorded, or the part cannot be read."""
