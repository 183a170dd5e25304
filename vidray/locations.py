"""Where a setting points: a local path or a URI (`s3://bucket/prefix`, `gs://...`, `file://...`).

Light on purpose (no pyarrow): the trainer's driver checks, the model export and the serve app test locations
without loading `vidray.storage`, which opens them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["NOT_A_FOLDER", "absolute_location", "creation_problem", "folder_write_problem", "is_uri"]


def is_uri(location: str | Path) -> bool:
    """True for `scheme://...` locations (`file://` included)."""
    return "://" in str(location)


def absolute_location(location: str) -> str:
    """A URI unchanged; a local path made absolute (`~` expanded, symlinks resolved), as a str."""
    return location if is_uri(location) else str(Path(location).expanduser().resolve())


def folder_write_problem(folder: str | Path) -> str | None:
    """Why nothing can be created in the existing local folder `folder` (the OS's reason, e.g. "Permission denied"),
    or None when something can. Tried, not read from permission bits, which say nothing for root or for
    filesystems such as /proc: a temporary folder is made there and removed at once."""
    try:
        Path(tempfile.mkdtemp(prefix=".vidray-write-check-", dir=folder)).rmdir()
    except OSError as err:
        return err.strerror or str(err)
    return None


NOT_A_FOLDER = "a file, not a folder"
"""`creation_problem`'s reason when the nearest existing ancestor is a file."""


def creation_problem(path: str | Path) -> tuple[Path, str | None]:
    """Whether the local `path` (a file or folder, existing or not, with any missing parents) can be created:
    (the nearest existing ancestor of `path`, or `path` itself when it exists; why nothing can be created there,
    or None). The reason is `NOT_A_FOLDER` or `folder_write_problem`'s."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return probe, NOT_A_FOLDER
    return probe, folder_write_problem(probe)
