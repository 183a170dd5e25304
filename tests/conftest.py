"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """The repo's `samples/` folder: six small real clips/stills and their EasyAnimate `metadata.json`."""
    return REPO_ROOT / "samples"


@pytest.fixture(scope="session")
def real_data_dir() -> Path:
    """The shared folder of eleven real media files (`$VIDRAY_REAL_DATA`, else `<repo>/../shared/data/real`);
    skips the test when it is absent."""
    path = Path(os.environ.get("VIDRAY_REAL_DATA") or REPO_ROOT.parent / "shared" / "data" / "real")
    if not (path / "SOURCES.md").is_file():
        pytest.skip(f"real media folder {path} not found; the rest of the suite runs on samples/")
    return path
