"""Job config: one YAML file per run -> typed, frozen sections, validated on the driver before Ray starts.

```python
job = load_job_config("jobs/configs/tiny_t2v.yaml", overrides=["optim.lr=3e-4", "train.max_steps=20"])
build_optimizer(model, job.optim)   # each component gets only its own section
```

Parsing and type checks are pydantic's (strict about unknown keys, `Literal` choices, types and the ranges written
in the types); this package only turns its errors into one `ConfigError` that names every dotted key at fault and
what would be valid. Its modules, each importing only those before it:

- `bounds`: bounded number types (`int >= 1`, `float in [0, 1)`) and the one-line words of a value out of range;
- `common`: what the sections share (the strict frozen section config, `ConfigError`);
- the sections, one frozen dataclass per section with the checks inside one section: `model` (`model:` and
  `model.i2v` / `lora` / `experts`), `data`, `train` (`flow`, `optim`, `train`, `export`, `vae_training`,
  `checkpoint`, `scaling`, `parallel`), `runtime` (`memory`, `placement`, `storage`);
- `job`: `JobConfig`, the sections of one run and the checks across sections;
- `resume`: which keys a resumed run may change (`RESUME_RULES`, `diff_for_resume`);
- `loading`: YAML and overrides -> `JobConfig` (`load_job_config`, `job_config_from_dict`), the error wording.
"""

from vidray.config.common import ConfigError
from vidray.config.data import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_DIR, DataConfig
from vidray.config.job import JobConfig
from vidray.config.loading import apply_overrides, check_output_path, job_config_from_dict, load_job_config
from vidray.config.model import (DEFAULT_LORA_TARGET_MODULES, WAN_CLIP_TEXT_TOKENS, ExpertsConfig, I2VConfig,
                                 LoraConfig, ModelConfig, StagePlacement)
from vidray.config.resume import (DICT_LEAVES, RESUME_CHANGEABLE, RESUME_FIXED, RESUME_RULES, ResumeDiff,
                                  diff_for_resume, flatten_config)
from vidray.config.runtime import (INFERENCE_OFFLOADS, STORAGE_DTYPES, EncodePlacement, MemoryConfig, PlacementConfig,
                                   StorageConfig)
from vidray.config.train import (CheckpointConfig, ContextParallelConfig, EMAConfig, ExportConfig, FlowConfig,
                                 OptimConfig, ParallelConfig, ScalingConfig, TrainConfig, ValidationConfig,
                                 VAETrainingConfig, parse_activation_checkpointing)

__all__ = [
    "CheckpointConfig", "ConfigError", "ContextParallelConfig", "DataConfig", "DEFAULT_CACHE_BYTES", "DEFAULT_CACHE_DIR",
    "DEFAULT_LORA_TARGET_MODULES", "DICT_LEAVES", "EMAConfig", "EncodePlacement", "ExpertsConfig", "ExportConfig",
    "FlowConfig", "I2VConfig", "INFERENCE_OFFLOADS", "JobConfig", "LoraConfig", "MemoryConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "PlacementConfig", "RESUME_CHANGEABLE", "RESUME_FIXED", "RESUME_RULES", "ResumeDiff",
    "STORAGE_DTYPES", "ScalingConfig", "StagePlacement", "StorageConfig", "TrainConfig", "ValidationConfig",
    "VAETrainingConfig", "WAN_CLIP_TEXT_TOKENS", "apply_overrides", "check_output_path", "diff_for_resume",
    "flatten_config", "job_config_from_dict", "load_job_config", "parse_activation_checkpointing",
]
