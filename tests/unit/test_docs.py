"""The docs cannot rot. In README.md and every `docs/*.md`:
- a fenced block marked ```` ```yaml test-config ```` is a valid job config (a fragment is merged onto the defaults);
- a fenced block marked ```` ```bash test-overrides ```` holds `section.key=value` overrides (shell-quoted) that
  load onto `jobs/configs/tiny_t2v.yaml`;
- a fenced block marked ```` ```bash test-command ```` runs and exits 0 (in a temp folder holding `jobs/` and
  `samples/`, with `vidray` the checkout's CLI and no `RAY_ADDRESS`: mark only commands that start no Ray);
- every dotted config key named in backticks exists, and every relative link points to a file (and heading) that
  exists;
- `docs/configuration.md` is what `python -m vidray.config_docs` writes from the config classes.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vidray import config_docs
from vidray.config import RESUME_RULES, job_config_from_dict, load_job_config

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = ("model", "data", "flow", "optim", "train", "checkpoint", "scaling", "storage", "placement", "export")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", flags=re.S | re.M)


def _name(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def blocks(marker: str) -> list[tuple[str, int, str]]:
    """(doc, block number in that doc, text) of every fenced block whose info string holds `marker`."""
    found = []
    for doc in DOCS:
        for number, match in enumerate(FENCE.finditer(doc.read_text()), start=1):
            if marker in match.group(1).split():
                found.append((_name(doc), number, match.group(2)))
    return found


CONFIG_BLOCKS = blocks("test-config")
COMMAND_BLOCKS = blocks("test-command")
OVERRIDE_BLOCKS = blocks("test-overrides")


def test_the_docs_mark_blocks_for_testing():
    assert len(CONFIG_BLOCKS) >= 3 and len(COMMAND_BLOCKS) >= 3, (CONFIG_BLOCKS, COMMAND_BLOCKS)


@pytest.mark.parametrize("doc,number,text", CONFIG_BLOCKS, ids=[f"{d}#{n}" for d, n, _ in CONFIG_BLOCKS])
def test_every_test_config_block_is_a_valid_job_config(doc, number, text):
    raw = yaml.safe_load(text)
    assert isinstance(raw, dict), f"{doc}, block {number}: not a YAML mapping"
    job_config_from_dict(raw)


@pytest.mark.parametrize("doc,number,text", OVERRIDE_BLOCKS, ids=[f"{d}#{n}" for d, n, _ in OVERRIDE_BLOCKS])
def test_every_test_overrides_block_loads_onto_the_tiny_job(doc, number, text):
    overrides = shlex.split(text.replace("\\\n", " "), comments=True)
    assert overrides and all("=" in o for o in overrides), f"{doc}, block {number}: not section.key=value overrides"
    load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", overrides)


@pytest.fixture(scope="module")
def command_dir(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A working folder with the repository's `jobs/` and `samples/`, and an environment whose `vidray` is this
    checkout's CLI, with no Ray cluster to join."""
    work = tmp_path_factory.mktemp("docs-commands")
    for name in ("jobs", "samples"):
        (work / name).symlink_to(REPO / name)
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "vidray"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vidray.cli "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO))
    return work, env


@pytest.mark.parametrize("doc,number,text", COMMAND_BLOCKS, ids=[f"{d}#{n}" for d, n, _ in COMMAND_BLOCKS])
def test_every_test_command_block_runs(doc, number, text, command_dir):
    work, env = command_dir
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (f"{doc}, block {number} exited {done.returncode}:\n{text}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_config_key_a_doc_names_exists(doc):
    keys = set(re.findall(r"`((?:%s)\.[a-z_.0-9]+)" % "|".join(SECTIONS), doc.read_text()))
    keys = {k for k in keys if not re.search(r"\.(py|md|yaml|json)$", k)}  # `train.py`, `optim.py`: files
    known = {key.name for key in config_docs.iter_keys()}  # every key and section, nested ones included
    unknown = sorted(k.rstrip(".") for k in keys if k.rstrip(".") not in known)
    assert not unknown, f"{_name(doc)} names config keys that do not exist: {unknown}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_relative_link_points_to_an_existing_file(doc):
    text = FENCE.sub("", doc.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{_name(doc)} has broken links: {broken}"


def test_readme_is_the_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme) <= 12_000, f"README.md has {len(readme)} characters; move detail into docs/ (limit 12,000)"
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_configuration_reference_is_up_to_date():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == config_docs.render(), (
        f"docs/configuration.md is out of date with vidray/config/: run `{config_docs.COMMAND}`")


def test_every_config_key_has_a_docstring():
    missing = [key.name for key in config_docs.iter_keys() if not key.doc]
    assert not missing, f"config fields without a docstring under them in vidray/config/: {missing}"


def test_configuration_reference_lists_every_key_with_its_resume_rule():
    text = (REPO / "docs" / "configuration.md").read_text()
    for key, rule in RESUME_RULES.items():
        assert re.search(rf"^- \*\*`{re.escape(key)}`\*\* .*, {rule}[:]", text, flags=re.M), key
