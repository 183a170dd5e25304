"""Issue 44 part 7: vidray's temp and cache folders are private. `private_dir` creates missing folders with mode 0700
and refuses another user's folder, a symlink, a folder every user can write, and a folder under one another user
owns; the serve store's temporary mp4s and the shard cache go through it, and files in them are opened exclusively
(a planted symlink is never followed)."""

from __future__ import annotations

import os
import stat

import pytest

from vidray.data.cache import ShardCache
from vidray.errors import UserError
from vidray.private_dirs import PrivateDirError, open_exclusive, private_dir
from vidray.serve.jobs import new_temp_mp4

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root (CI runs as root)")


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_missing_folders_are_created_0700_and_an_own_private_folder_is_accepted(tmp_path):
    folder = private_dir(tmp_path / "a" / "b" / "c")
    assert folder.is_dir()
    assert [_mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    assert private_dir(folder) == folder  # checked again: fine
    mp4 = new_temp_mp4(tmp_path / "store" / "tmp")
    assert mp4.suffix == ".mp4" and _mode(mp4) == 0o600 and _mode(mp4.parent) == 0o700


@as_root
def test_another_users_folder_is_refused_in_one_line(tmp_path):
    theirs = tmp_path / "vidray-serve"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivateDirError) as refused:
        new_temp_mp4(theirs / "0123abcd")  # the head store's temp mp4s under a folder someone else made first
    message = str(refused.value)
    assert "\n" not in message and f"{theirs} (a folder above it) is owned by uid {OTHER_UID}" in message
    assert not (theirs / "0123abcd").exists()
    with pytest.raises(PrivateDirError, match=f"{theirs} is owned by uid {OTHER_UID}, not by you"):
        private_dir(theirs)


def test_a_symlink_in_place_of_the_folder_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "vidray-cache").symlink_to(target)
    with pytest.raises(PrivateDirError, match=r"vidray-cache is a symlink"):
        private_dir(tmp_path / "vidray-cache")
    with pytest.raises(UserError, match=r"shard cache: folder .*vidray-cache is a symlink.*set data.cache_dir"):
        ShardCache(tmp_path / "vidray-cache", budget_bytes=2**20)
    assert list(target.iterdir()) == []  # nothing was created through it


@as_root
def test_a_symlink_of_another_user_above_the_folder_is_refused(tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivateDirError, match=f"link is a symlink owned by uid {OTHER_UID}"):
        private_dir(link / "cache")


def test_a_folder_every_user_can_write_is_refused_unless_it_is_a_sticky_parent(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PrivateDirError, match=r"shared is writable by every user \(mode 777\)"):
        private_dir(shared)
    with pytest.raises(PrivateDirError, match=r"shared is writable by every user"):
        private_dir(shared / "mine")  # anyone could rename "mine" away and put theirs in its place
    shared.chmod(0o1777)  # sticky, like /tmp: only the owner renames an entry
    assert _mode(private_dir(shared / "mine")) == 0o700


def test_open_exclusive_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    planted = tmp_path / "a.parquet.123.tmp"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        open_exclusive(planted)
    assert victim.read_text() == "keep"
    fd = open_exclusive(tmp_path / "new.tmp")
    os.close(fd)
    assert _mode(tmp_path / "new.tmp") == 0o600


@as_root
def test_a_mount_of_root_that_every_user_can_write_is_accepted_and_what_is_made_inside_is_private(tmp_path,
                                                                                                  monkeypatch):
    """The KubeRay configs mount an emptyDir (root's, mode 0777, no sticky bit) at the default cache folder: a
    mount point is a volume only that pod's containers reach, so it is accepted; the cache's own folders inside
    are made 0700 and checked. A folder that is not a mount point, the same otherwise, is refused."""
    volume = tmp_path / "vidray-cache"
    volume.mkdir()
    volume.chmod(0o777)
    with pytest.raises(PrivateDirError, match="is writable by every user"):
        private_dir(volume)
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(volume) or real_ismount(p))
    cache = ShardCache(volume, budget_bytes=2**20)
    assert [_mode(volume / d) for d in ("shards", "locks", "reserved")] == [0o700] * 3
    assert cache.cache_dir == volume
