"""The warm tier: a node-local disk cache of shard files fetched from object storage.

```python
cache = ShardCache("/tmp/vidray-cache", budget_bytes=20 * 2**30)
cache.check_budget(index)                      # UserError at start-up when the largest shard cannot fit
with cache.lease(storage, index["shards"][0]) as path:   # downloaded once per node, pinned while the block runs
    table = pq.read_table(path)
```

- Key: the shard's sha256 from `index.json` (`<cache_dir>/shards/<sha256>.parquet`): content-addressed, so a
  re-prepare, another dataset or another bucket never reads stale bytes, and equal shards are stored once.
- Budget: `data.cache_bytes` bounds the bytes of cached shards. Before a download, least recently used files
  (mtime, refreshed on every hit) are evicted until the new shard fits. A file in use is never evicted: every
  lease holds a shared `flock` on the key's lock file (`<cache_dir>/locks/<sha256>.lock`), and eviction only
  takes files whose lock it can take exclusively without waiting. When pinned files leave no room, `lease`
  raises UserError naming the numbers instead of waiting.
- Downloads are atomic (`<key>.parquet.<pid>.tmp`, then rename) and checked against the sha256; a mismatch is
  deleted and downloaded once more, then ShardChecksumError (the caller skips the shard and counts it).
- Downloads in flight count against the budget: under the cache's eviction lock a downloader makes room for its
  shard counting every live reservation, then writes its own (`<cache_dir>/reserved/<key>.<pid>.<thread>`, the
  size in bytes), removed when the download ends. So processes downloading at once never hold more than the
  budget on disk (the file and its reservation briefly count twice). Reservations and temp files of processes
  that died (killed mid-download) are removed when a cache is opened and whenever room is made.
- One download per shard per node: the downloader holds the key's lock exclusively; another process that
  wants the same shard waits on that lock, then finds the file cached (counted as a hit).
- Local shard folders are not copied here: `vidray.data.shards.open_shard` reads them in place (hashing them).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from vidray.config import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_DIR
from vidray.data.format import ShardChecksumError
from vidray.storage import check_sha256
from vidray.errors import UserError
from vidray.private_dirs import PrivateDirError, open_exclusive, private_dir



@dataclass
class CacheStats:
    """Counts of this process's `ShardCache` (bytes in bytes)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    evicted: list[str] = field(default_factory=list)
    """Keys (sha256) evicted by this process, oldest first."""


def check_cache_budget(cache_bytes: int, index: dict[str, Any], *, local_ranks: int | None = None) -> None:
    """Raise UserError when `cache_bytes` cannot hold the shards training pins at once, so the run is refused at
    start-up rather than left to stall. `index`: an `index.json` dict.

    Without `local_ranks` (the driver, which does not know the placement): the largest shard must fit. With it
    (a worker, knowing how many ranks share its node's cache): each rank's loader pins at most two shards at once
    (the one it decodes from and the one its prefetcher downloads, `vidray.data.pipeline`), so the budget must hold
    2 x local_ranks x the largest shard."""
    largest = max((int(s.get("bytes", 0)) for s in index.get("shards", [])), default=0)
    fix = "(better a few times that), or prepare smaller shards (data.samples_per_shard)"
    if local_ranks is None:
        if largest > cache_bytes:
            raise UserError(f"data.cache_bytes={cache_bytes} is smaller than the largest shard ({largest} bytes): "
                            f"raise it to at least {largest} {fix}")
        return
    need = 2 * local_ranks * largest
    if cache_bytes < need:
        raise UserError(
            f"data.cache_bytes={cache_bytes} cannot hold the shards {local_ranks} rank(s) of this node read at once "
            f"(2 per rank x the largest shard, {largest} bytes = {need}): raise data.cache_bytes to at least {need} "
            f"{fix}"
        )


class ShardCache:
    """Node-local, content-addressed disk cache of shards under a byte budget (see the module docstring).

    `cache_dir`: the folder (created private: `vidray.private_dirs.private_dir`); `budget_bytes`: most bytes of
    cached shards (> 0). Raises ValueError for a budget < 1 and UserError when `cache_dir` cannot be created or is
    not private (another user's folder, a symlink, writable by every user)."""

    def __init__(self, cache_dir: str | Path = DEFAULT_CACHE_DIR, budget_bytes: int = DEFAULT_CACHE_BYTES):
        if budget_bytes < 1:
            raise ValueError(f"data.cache_bytes must be >= 1 byte, got {budget_bytes}")
        self.cache_dir = Path(cache_dir)
        self.budget_bytes = int(budget_bytes)
        self.files_dir = self.cache_dir / "shards"
        self.locks_dir = self.cache_dir / "locks"
        self.reserved_dir = self.cache_dir / "reserved"
        try:  # private: 0700, ours, no symlink (the default is under the shared temp folder)
            for folder in (self.cache_dir, self.files_dir, self.locks_dir, self.reserved_dir):
                private_dir(folder)
        except PrivateDirError as err:
            raise UserError(f"shard cache: {err}; set data.cache_dir to a writable node-local folder of yours") \
                from None
        self.stats = CacheStats()
        self.sweep_dead()

    def sweep_dead(self) -> int:
        """Remove the temp files and reservations of processes that no longer run (a download killed midway);
        returns how many. Their names carry the writer's PID; the cache is node-local, so the PID is this node's."""
        removed = 0
        for path in [*self.files_dir.glob("*.tmp"), *self.reserved_dir.iterdir()]:
            pid = _pid_in_name(path.name)
            if pid is not None and not _alive(pid):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def reserved_bytes(self) -> int:
        """Bytes of the downloads in flight on this node (live reservations)."""
        total = 0
        for path in self.reserved_dir.iterdir():
            pid = _pid_in_name(path.name)
            try:
                total += int(path.read_text()) if pid is not None and _alive(pid) else 0
            except (OSError, ValueError):
                continue  # finished (removed) meanwhile, or half written: its download has not started
        return total

    def path(self, sha256: str) -> Path:
        """The cache file of the shard with this sha256. Raises UnsafePathError (a UserError) unless it is 64
        lowercase hex characters: it becomes a file name (`vidray.storage.check_sha256`)."""
        return self.files_dir / f"{check_sha256(sha256, what='shard sha256')}.parquet"

    def check_budget(self, index: dict[str, Any]) -> None:
        """`check_cache_budget(self.budget_bytes, index)`."""
        check_cache_budget(self.budget_bytes, index)

    def cached_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files_dir.glob("*.parquet") if p.is_file())

    @contextmanager
    def lease(self, storage: Any, entry: dict[str, Any]) -> Iterator[Path]:
        """The local path of the shard `entry` ({file, bytes, sha256} from `index.json`) of `storage`
        (`vidray.storage.Storage`), downloaded if needed; pinned (never evicted) until the block ends.
        Raises ShardChecksumError when the download differs from its sha256 twice, UserError when the budget
        has no room that eviction can free."""
        with self.lease_info(storage, entry) as (path, _downloaded):
            yield path

    @contextmanager
    def lease_info(self, storage: Any, entry: dict[str, Any]) -> Iterator[tuple[Path, bool]]:
        """`lease`, yielding (path, downloaded): whether this call fetched the shard from `storage` (False when it
        was cached, or another process downloaded it while this one waited). Safe to use from several threads."""
        path = self.path(entry["sha256"])
        key = entry["sha256"]
        fd = os.open(self.locks_dir / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            downloaded = False
            while True:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if path.is_file():
                    break
                # Missing: convert to exclusive (flock drops the shared lock first, so two would-be downloaders
                # cannot deadlock); the first downloads, the others wait here and then find the file.
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not path.is_file():
                    self._download(storage, entry, path)
                    downloaded = True
                # Back to shared; an evictor may have slipped in between (it needs an exclusive lock): re-check.
            os.utime(path)  # LRU: most recently used now
            if not downloaded:
                self.stats.hits += 1
            yield path, downloaded
        finally:
            os.close(fd)  # releases the shared lock: the file may now be evicted

    def _download(self, storage: Any, entry: dict[str, Any], path: Path) -> None:
        """Fetch `entry` into `path` (temp file + rename), after making room and reserving its bytes; verify its
        sha256 (one retry)."""
        size = int(entry.get("bytes") or storage.size(entry["file"]))
        reservation = self._make_room(size, keep=entry["sha256"])
        try:
            self._fetch_checked(storage, entry, path)
        finally:
            reservation.unlink(missing_ok=True)

    def _fetch_checked(self, storage: Any, entry: dict[str, Any], path: Path) -> None:
        """Download `entry` to a temp file beside `path` and rename it there when its sha256 matches (one retry);
        raises ShardChecksumError after two mismatches."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        for attempt in range(2):
            digest = hashlib.sha256()
            tmp.unlink(missing_ok=True)  # this PID's own leftover: opened exclusively below (no symlink followed)
            with storage.open_input_file(entry["file"]) as src, os.fdopen(open_exclusive(tmp), "wb") as dst:
                while chunk := src.read(8 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
            self.stats.bytes_downloaded += tmp.stat().st_size
            if digest.hexdigest() == entry["sha256"]:
                os.replace(tmp, path)
                self.stats.downloads += 1
                return
            tmp.unlink()
            self.stats.checksum_failures += 1
        raise ShardChecksumError(
            f"shard {storage.display(entry['file'])} has sha256 {digest.hexdigest()[:16]}... but index.json records "
            f"{entry['sha256'][:16]}... (downloaded twice): corrupt or replaced; re-run `vidray prepare`",
            entry["file"],
        )

    def _make_room(self, size: int, keep: str) -> Path:
        """Evict least recently used, unpinned shards until `size` more bytes fit the budget beside the cached
        shards and every live reservation, then reserve them (under the cache's own lock, so two processes do not
        both count the same free room). Returns the reservation file: the caller removes it when its download
        ends."""
        if size > self.budget_bytes:
            raise UserError(f"data.cache_bytes={self.budget_bytes} is smaller than shard size {size} bytes: raise it "
                            f"to at least {size}")
        lock_fd = os.open(self.cache_dir / ".evict.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self.sweep_dead()
            # Reservations before files: a download renames its file, then drops its reservation, so one that
            # ends between the two reads is counted twice (safe), never zero times.
            reserved = self.reserved_bytes()
            files = []
            for p in self.files_dir.glob("*.parquet"):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, p, st.st_size))
            used = sum(f[2] for f in files) + reserved
            pinned = 0
            for _mtime, p, nbytes in sorted(files, key=lambda f: f[0]):  # oldest first
                if used + size <= self.budget_bytes:
                    break
                key = p.name.removesuffix(".parquet")
                if key == keep:
                    continue
                kfd = os.open(self.locks_dir / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(kfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pinned += nbytes  # in use by a lease: never evicted
                    continue
                else:
                    p.unlink(missing_ok=True)
                    used -= nbytes
                    self.stats.evictions += 1
                    self.stats.evicted.append(key)
                finally:
                    os.close(kfd)
            if used + size > self.budget_bytes:
                raise UserError(
                    f"data.cache_bytes={self.budget_bytes} cannot hold another {size}-byte shard: {pinned} bytes are "
                    f"pinned by shards in use and {reserved} bytes reserved by downloads in flight in "
                    f"{self.cache_dir}; raise data.cache_bytes to at least {pinned + reserved + size}"
                )
            reservation = self.reserved_dir / f"{keep}.{os.getpid()}.{threading.get_ident()}"
            reservation.write_text(str(size))
            return reservation
        finally:
            os.close(lock_fd)


def _pid_in_name(name: str) -> int | None:
    """The writer's PID in a temp file's (`<key>.parquet.<pid>.tmp`) or a reservation's (`<key>.<pid>.<thread>`)
    name, or None."""
    parts = name.split(".")
    candidate = parts[-2] if name.endswith(".tmp") else (parts[1] if len(parts) == 3 else "")
    return int(candidate) if candidate.isdigit() else None


def _alive(pid: int) -> bool:
    """Whether a process with this PID runs on this node."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

