"""Private folders for vidray's temp files and caches (the serve ingress's temporary mp4s, the shard cache, the
metrics textfiles of a run on object storage): many live under the machine's world-writable temp folder (`/tmp`)
at fixed names, where another user could create the folder first, or a symlink in its place, and then read or swap
what vidray writes there.

`private_dir(path)` makes the folder (each missing component with mode 0700) or checks the one there: a real
folder, not a symlink, owned by this user and not writable by others; and every folder above it owned by this user
or root, not writable by others unless sticky (as `/tmp` is). A mount point owned by this user or root is accepted
as it is (a Kubernetes emptyDir, root's and 0777, such as the KubeRay configs mount at the default cache folder:
only that pod's containers reach it), the folders made inside it are checked as above. `open_exclusive` creates a new file that no one else
made first (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600). The model is OpenSSH's StrictModes and Python's own
`tempfile.mkstemp` (O_EXCL, 0600).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from vidray.errors import UserError

__all__ = ["PrivateDirError", "open_exclusive", "private_dir"]


class PrivateDirError(UserError):
    """A temp or cache folder that another user could read or swap; the message names it and the fix."""


def _problem(path: Path, st: os.stat_result, *, final: bool) -> str | None:
    """What makes the folder `path` (its lstat `st`) unsafe to keep vidray's files in, or None."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        if final:
            return "is a symlink"
        if st.st_uid not in (uid, 0):
            return f"is a symlink owned by uid {st.st_uid}, not by you (uid {uid}) or root"
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid in (uid, 0) and os.path.ismount(path):  # a volume of its own (a Kubernetes emptyDir is root's, 0777
        return None  # without the sticky bit): only this pod's containers reach it; what vidray makes inside is checked
    if final and st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if not final and st.st_uid not in (uid, 0):
        return f"(a folder above it) is owned by uid {st.st_uid}, not by you (uid {uid}) or root"
    if st.st_mode & stat.S_IWOTH and not (not final and st.st_mode & stat.S_ISVTX):
        return f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(path: str | Path) -> Path:
    """Make `path` a folder only this user can change (see the module docstring) and return it: missing
    components are created with mode 0700, existing ones checked. Raises PrivateDirError naming the first
    component at fault (another user's folder, a symlink, a folder every user can write) and the fix, or when a
    component cannot be created (OSError's reason)."""
    path = Path(os.path.abspath(path))
    parts = [*reversed(path.parents), path]
    for i, component in enumerate(parts):
        final = i == len(parts) - 1
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            try:
                os.mkdir(component, 0o700)
            except FileExistsError:  # another process of ours (or not: checked below) made it meanwhile
                pass
            except OSError as err:
                raise PrivateDirError(f"cannot create the folder {component} ({err.strerror}); give a folder of "
                                      "yours instead") from None
            st = os.lstat(component)
        problem = _problem(component, st, final=final)
        if problem:
            raise PrivateDirError(f"folder {component} {problem}: vidray keeps temp and cache files only in folders "
                                  f"no other user can change; remove it or give a folder of yours instead of {path}")
    return path


def open_exclusive(path: str | Path, mode: int = 0o600) -> int:
    """A write-only file descriptor of a new file `path` (`O_CREAT | O_EXCL | O_NOFOLLOW`: fails if anything,
    a symlink included, is already there), created with `mode`. Raises FileExistsError, or OSError."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
