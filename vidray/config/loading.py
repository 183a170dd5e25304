"""Loading a job config: YAML + `section.key=value` overrides -> a validated `JobConfig`
(`load_job_config`, `job_config_from_dict`), pydantic's errors turned into one `ConfigError` line per key at
fault, and the output-folder check (`check_output_path`)."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from vidray.config.bounds import BOUND_ERRORS, bound_message
from vidray.config.job import _ADAPTER, JobConfig
from vidray.config.common import ConfigError
from vidray.errors import UserError, UserFileNotFound
from vidray.locations import NOT_A_FOLDER, creation_problem


def _field_hint(path: Sequence[str | int], *, extras: bool = False) -> Any:
    """The type hint of the setting at a dotted location (`["optim", "betas"]` -> tuple[float, float]; `[]` ->
    JobConfig), or None when there is no such setting. `extras`: the setting's own hint keeps its `Annotated`
    metadata (its bounds, `vidray.config.bounds`)."""
    cls: Any = JobConfig
    for i, part in enumerate(path):
        last = extras and i == len(path) - 1
        hints = typing.get_type_hints(cls, include_extras=last) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
        if last:
            return cls
        sections = [a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)]
        if len(sections) == 1 and type(None) in typing.get_args(cls):  # a nullable section (`model.lora`)
            cls = sections[0]
    return cls


def _section_fields(path: Sequence[str | int]) -> list[str] | None:
    """Valid keys at a dotted location (for 'unknown key' messages), or None if not a section."""
    cls = _field_hint(path)
    if cls is not None and dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = ".".join(loc) or "<root>"
        parent = _field_hint(loc[:-1]) if loc and loc[-1].isdigit() else None
        if typing.get_origin(parent) is tuple and e["type"] in ("missing", "too_long", "too_short"):
            # a fixed-length list setting (optim.betas): name it, not its element ('optim.betas.1')
            lines.append(f"'{'.'.join(loc[:-1])}' must be a list of {len(typing.get_args(parent))} values, got "
                         f"{e['input']!r}")
            continue
        if typing.get_origin(parent) is tuple and e["type"] in BOUND_ERRORS:  # 'optim.betas' value 2 of 2
            elements = typing.get_args(_field_hint(loc[:-1], extras=True))
            lines.append(bound_message(f"{'.'.join(loc[:-1])} value {int(loc[-1]) + 1} of {len(elements)}",
                                       elements[int(loc[-1])], e["input"]))
            continue
        if typing.get_origin(parent) is tuple:  # one element of it is wrong: 'optim.betas' value 2 of 2
            lines.append(f"wrong value {e['input']!r} for '{'.'.join(loc[:-1])}' (value {int(loc[-1]) + 1} of "
                         f"{len(typing.get_args(parent))}): {e['msg']}")
            continue
        if e["type"] in ("too_long", "too_short") and typing.get_origin(_field_hint(loc)) is tuple:
            args = typing.get_args(_field_hint(loc))
            lines.append(f"'{key}' must be a list of {len(args)} values, got {e['input']!r}")
            continue
        if e["input"] is None and e["type"] not in ("missing", "extra_forbidden", "unexpected_keyword_argument"):
            lines.append(f"'{key}' is empty (an empty YAML value or `{key}=` override reads as null): give it a "
                         f"value ({e['msg']})")
            continue
        if e["type"] in BOUND_ERRORS:  # a bound written in the setting's type (`vidray.config.bounds`)
            lines.append(bound_message(key, _field_hint(loc, extras=True), e["input"]))
            continue
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


def check_output_path(path: str | Path, key: str) -> Path:
    """Refuse an output folder that cannot be created or written, naming `key` (e.g. `storage.path`).

    Walks up to the nearest existing ancestor: it must be a folder in which this process can create a folder
    (`vidray.locations.creation_problem`: tried, not read from permission bits). Returns the resolved path
    (not created). Raises ConfigError, e.g. "storage.path /etc/hostname/runs cannot be created: /etc/hostname is a
    file, not a folder".
    """
    target = Path(path).expanduser().resolve()
    probe, problem = creation_problem(target)
    if problem == NOT_A_FOLDER:
        raise ConfigError(f"{key} {target} cannot be created: {probe} is a file, not a folder; choose another {key}")
    if problem:
        raise ConfigError(f"{key} {target} cannot be written: no folder can be created in {probe} ({problem}); "
                          f"choose another {key} or fix its permissions")
    return target


def job_config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """Validate a nested dict into a `JobConfig`. Raises ConfigError naming every dotted key at fault."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a job config must be a mapping of sections, got {type(raw).__name__}")
    type_errors = _scalar_type_errors(raw)
    if type_errors:
        raise ConfigError("; ".join(type_errors))
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def _scalar_type_errors(raw: dict[str, Any]) -> list[str]:
    """Booleans given for numbers (`train.max_steps: true`, which pydantic's lax mode reads as 1) and non-booleans
    given for booleans (`scaling.use_gpu: 1` or "yes"); YAML's true/false are the only booleans. One message per key."""
    errors = []
    for section in dataclasses.fields(JobConfig):
        values = raw.get(section.name)
        if not isinstance(values, dict) or not dataclasses.is_dataclass(section.default_factory):
            continue
        hints = typing.get_type_hints(section.default_factory)
        for field in dataclasses.fields(section.default_factory):
            if field.name not in values:
                continue
            key, value, hint = f"{section.name}.{field.name}", values[field.name], hints[field.name]
            kinds = {a for a in typing.get_args(hint) if a is not type(None)} or {hint}
            if typing.get_origin(hint) is tuple:  # optim.betas: each element a number
                items = value if isinstance(value, (list, tuple)) else []
                if any(isinstance(v, bool) for v in items):
                    errors.append(f"'{key}': {value!r} holds a boolean; give numbers, e.g. {list(field.default)}")
            elif kinds & {int, float} and isinstance(value, bool):
                default = field.default if field.default is not dataclasses.MISSING else 1
                errors.append(f"'{key}': {str(value).lower()} is a boolean, not a number; give a number, e.g. {default}")
            elif float in kinds and isinstance(value, float) and not math.isfinite(value):
                errors.append(f"'{key}': {value} is not a finite number; give a number, e.g. {field.default}")
            elif kinds == {bool} and not isinstance(value, bool):
                errors.append(f"'{key}': {value!r} is not a boolean; give true or false")
    return errors


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (value parsed as YAML: `3e-4`, `true`, `[[9,64,64]]`) to a nested dict.

    Raises ConfigError for an override without '=', one whose value is not valid YAML (e.g. an unclosed `[`), or one
    that descends into a non-section value.
    """
    out = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); close its brackets, e.g. "
                              "'data.buckets=[[17, 64, 64]]', and quote a text that holds ': ' or '#', e.g. "
                              "'name=\"a: b\"'") from None
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

    Raises UserFileNotFound for a missing file, UserError for a folder, and ConfigError for bad YAML or bad
    values; all of it on the caller's process, before any Ray resource is reserved.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            names = sorted(p.name for p in path.glob("*.yaml"))
            examples = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise UserError(f"job config {path} is a folder, not a YAML file; give one file"
                            + (f" (it holds {examples})" if examples else ""))
        if not path.is_file():
            raise UserFileNotFound(f"job config {path} does not exist; the examples live in jobs/configs/")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if raw is None:
            raise ConfigError(f"{path} is empty: a job config needs at least a name and a data section")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a job config must be a mapping of sections, got {type(raw).__name__}")
    return job_config_from_dict(apply_overrides(raw, overrides))
