"""The docs cannot rot: every YAML block in `docs/*.md` is a valid job config (merged onto the tiny job), and every
dotted config key a doc names in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vidray.config import RESUME_RULES, job_config_from_dict

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
SECTIONS = ("model", "data", "flow", "optim", "train", "checkpoint", "scaling", "storage", "placement", "export")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_yaml_block_of_a_doc_is_a_valid_job_config(doc):
    blocks = re.findall(r"```yaml\n(.*?)```", doc.read_text(), flags=re.S)
    for block in blocks:
        raw = yaml.safe_load(block)
        if raw.get("train", {}).get("mixed_precision") == "fp16" or raw.get("train", {}).get("grad_compression") == "bf16":
            raw.setdefault("scaling", {})["use_gpu"] = True
        job_config_from_dict(raw)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_a_doc_names_exists(doc):
    keys = set(re.findall(r"`((?:%s)\.[a-z_.0-9]+)" % "|".join(SECTIONS), doc.read_text()))
    leaves = set(RESUME_RULES)
    sections = {k.rsplit(".", 1)[0] for k in leaves} | {k.rsplit(".", 2)[0] for k in leaves if k.count(".") > 1}
    unknown = sorted(k.rstrip(".") for k in keys if k.rstrip(".") not in leaves | sections)
    assert not unknown, f"{doc.name} names config keys that do not exist: {unknown}"
