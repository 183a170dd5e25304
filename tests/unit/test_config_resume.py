"""Resume rules: every config key is classified fixed or changeable, and a diff sorts changes by that rule."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest

from vidray.config import (
    DICT_LEAVES,
    RESUME_CHANGEABLE,
    RESUME_FIXED,
    RESUME_RULES,
    JobConfig,
    check_output_path,
    ConfigError,
    diff_for_resume,
    flatten_config,
    load_job_config,
)

REPO = Path(__file__).resolve().parents[2]


def leaf_fields(cls=JobConfig, prefix: str = "") -> set[str]:
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.name in DICT_LEAVES:  # a section compared as one value (model.lora)
            out.add(f"{prefix}{f.name}")
        elif dataclasses.is_dataclass(hint):
            out |= leaf_fields(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) in (typing.Union, types.UnionType) and any(
                dataclasses.is_dataclass(a) for a in typing.get_args(hint)):  # an optional section: null or its keys
            section = next(a for a in typing.get_args(hint) if dataclasses.is_dataclass(a))
            out |= {f"{prefix}{f.name}"} | leaf_fields(section, f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def test_every_config_field_has_a_resume_rule_and_nothing_else_does():
    assert leaf_fields() == set(RESUME_RULES)
    assert set(RESUME_RULES.values()) == {RESUME_FIXED, RESUME_CHANGEABLE}


def test_training_doc_lists_every_key_under_its_rule():
    doc = (REPO / "docs" / "training.md").read_text()
    section = doc[doc.index("Fixed for the run"):]
    fixed_part, changeable_part = section.split("Changeable on resume", 1)
    changeable_part = changeable_part.split("\n\n", 1)[0]
    for key, rule in RESUME_RULES.items():
        assert f"`{key}`" in (fixed_part if rule == RESUME_FIXED else changeable_part), key


def test_model_data_flow_and_seed_are_fixed_optim_cadences_and_resources_changeable():
    for key in ("model.text_encoder", "model.preset", "data.buckets", "data.fps", "flow.shift", "train.seed",
                "data.batch_size_per_worker"):
        assert RESUME_RULES[key] == RESUME_FIXED, key
    for key in ("optim.lr", "optim.warmup_steps", "train.max_steps", "train.log_every_steps",
                "checkpoint.every_steps", "checkpoint.num_to_keep", "train.max_failures", "scaling.num_workers",
                "scaling.use_gpu", "scaling.cpus_per_worker", "train.grad_clip_norm"):
        assert RESUME_RULES[key] == RESUME_CHANGEABLE, key


def test_diff_sorts_changes_and_names_both_values():
    saved = load_job_config(None, ["optim.lr=1e-3", "train.max_steps=10"]).to_dict()
    job = load_job_config(None, ["optim.lr=1e-5", "train.max_steps=20", "model.text_encoder=tiny_random",
                                 "data.buckets=[[9, 64, 64]]"])
    diff = diff_for_resume(saved, job)
    assert diff.fixed == {"model.text_encoder": ("minilm", "tiny_random"),
                          "data.buckets": ([[9, 64, 64], [1, 64, 64]], [[9, 64, 64]])}
    assert diff.changeable == {"optim.lr": (1e-3, 1e-5), "train.max_steps": (10, 20)}
    assert diff.summary() == "optim.lr: 0.001 -> 1e-05, train.max_steps: 10 -> 20"


def test_same_config_and_older_saved_configs_show_no_change():
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml")
    assert diff_for_resume(job.to_dict(), job).summary() == ""
    saved = job.to_dict()
    del saved["flow"]  # a config saved before a section existed compares as unchanged
    saved["optim"]["betas"] = list(saved["optim"]["betas"])  # YAML reads tuples back as lists
    assert diff_for_resume(saved, job) == diff_for_resume(job.to_dict(), job)
    assert flatten_config({"a": {"b": 1, "c": {"d": 2}}}) == {"a.b": 1, "a.c.d": 2}


def test_unwritable_output_paths_are_refused_naming_the_key(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=rf"storage.path {blocker}/runs cannot be created: {blocker} is a file"):
        check_output_path(blocker / "runs", "storage.path")
    with pytest.raises(ConfigError, match="data.shards_dir"):
        check_output_path(blocker / "x" / "y", "data.shards_dir")
    assert check_output_path(tmp_path / "new" / "deeper", "storage.path") == (tmp_path / "new" / "deeper").resolve()


def test_resume_lines_show_values_as_yaml_writes_them():
    # A new user's trial: "train.micro_batches_per_step: 2 -> None" where the config says null.
    from vidray.config import ResumeDiff

    diff = ResumeDiff(fixed={"train.mixed_precision": (None, "bf16")},
                      changeable={"train.micro_batches_per_step": (2, None), "scaling.use_gpu": (False, True),
                                  "optim.lr": (0.001, 1e-05), "name": ("a", "b")})
    assert diff.summary() == ("train.micro_batches_per_step: 2 -> null, scaling.use_gpu: false -> true, "
                              "optim.lr: 0.001 -> 1e-05, name: 'a' -> 'b'")
    assert diff.fixed_summary() == "train.mixed_precision: null -> 'bf16'"
