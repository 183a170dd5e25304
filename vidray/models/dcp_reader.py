"""Reading a sharded (`torch.distributed.checkpoint`, DCP) checkpoint without running code from storage.

torch 2.13's `FileSystemReader.read_metadata` reads `.metadata` with `pickle.load`, and its `DefaultLoadPlanner`
reads every non-tensor entry (an optimizer's `lr`, `betas`, `step`) with `torch.load(weights_only=False)`: whoever
can write a run folder or a model's bucket prefix (and rewrite the manifest's sha256s to match, which proves
integrity, not authorship) could run code on every rank at the next resume. Here

- `read_dcp_metadata` unpickles `.metadata` with `DcpMetadataUnpickler`, which resolves only the globals a DCP
  metadata file holds (`DCP_METADATA_GLOBALS`: DCP's metadata classes, `torch.Size`, torch dtypes and layouts,
  `pathlib` paths, plain containers), then checks its shape (every storage entry a bare file name in the folder);
- `SafeFileSystemReader` (a `FileSystemReader`) reads `.metadata` that way, and hands the planner each non-tensor
  entry only after `torch.load(weights_only=True)` has read it (re-saved from the safe objects, so the planner's
  own `torch.load` sees only what the safe load built). Tensor entries are torch's own `weights_only=True` load.

Anything else is a `DamagedCheckpointError` naming the folder and the file, on one line, before any of its
objects is built. `dcp_errors(reader)` raises that error itself however DCP wrapped it (a swallowed
`read_metadata`, a `CheckpointException` carrying each rank's failure).

Source: Python docs, "pickle: Restricting Globals"; torch 2.13 `torch/distributed/checkpoint/filesystem.py`
(`FileSystemReader.read_metadata`, `read_data`) and `default_planner.py` (`DefaultLoadPlanner.load_bytes`).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from vidray.models.formats import DamagedCheckpointError

__all__ = ["DCP_METADATA_GLOBALS", "DcpMetadataUnpickler", "SafeFileSystemReader", "dcp_errors", "read_dcp_metadata"]

METADATA_FILE = ".metadata"
"""The DCP folder's metadata file (rank 0 writes it)."""

_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))

DCP_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}) | _DTYPES,
    "torch.serialization": frozenset({"_get_layout"}),  # torch.strided etc. by name (a dict lookup)
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
"""Module -> the names a DCP `.metadata` may refer to (what torch 2.13 writes for model, optimizer and EMA state).
Constructing any of them runs no code of the file's choosing."""


class UnsafeDcpData(ValueError):
    """A DCP file refers to something a checkpoint never holds (raised by the unpicklers, turned into a
    DamagedCheckpointError naming the folder)."""


class DcpMetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `DCP_METADATA_GLOBALS`; any other global raises UnsafeDcpData before
    it is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeDcpData(f"it refers to {module}.{name}, which a DCP metadata file never holds")


def _check_metadata(metadata: Any) -> Metadata:
    """The unpickled object's shape: a Metadata whose storage entries are bare `.distcp` file names (no folder, no
    `..`: nothing outside the DCP folder is read). Raises UnsafeDcpData."""
    if not isinstance(metadata, Metadata):
        raise UnsafeDcpData(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise UnsafeDcpData("its state_dict_metadata or storage_data is not a dict")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeDcpData(f"storage entry {index!r} is not a MetadataIndex -> _StorageInfo")
        name = info.relative_path
        if (not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".")
                or not isinstance(info.offset, int) or not isinstance(info.length, int)
                or info.offset < 0 or info.length < 0):
            raise UnsafeDcpData(f"storage entry {index.fqn!r} points at {name!r} (offset {info.offset!r}, length "
                                f"{info.length!r}), not a file of the DCP folder")
    return metadata


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The DCP metadata in file `path` (a DCP folder's `.metadata`), unpickled with `DcpMetadataUnpickler` and its
    shape checked. Raises DamagedCheckpointError (one line, naming the checkpoint folder and the file) when it
    refers to anything else, is not DCP metadata, or cannot be read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _check_metadata(DcpMetadataUnpickler(f).load())
    except (UnsafeDcpData, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, KeyError,
            IndexError) as err:
        raise _damaged(path.parent, path.name, err) from None


def _damaged(dcp_dir: Path, file: str, err: BaseException, entry: str | None = None) -> DamagedCheckpointError:
    checkpoint = dcp_dir.parent
    part = f"{dcp_dir.name}/{file}"
    reason = " ".join(str(err).split())[:200] or type(err).__name__
    where = part if entry is None else f"{part} (entry {entry!r})"
    return DamagedCheckpointError(
        f"checkpoint {checkpoint}: {where} is not a checkpoint vidray wrote ({reason}); refused unread: its manifest "
        "proves the bytes are the ones recorded, not who wrote them: use an earlier checkpoint",
        directory=checkpoint, part=part)


class _SafeBytesPlanner:
    """A LoadPlanner seen through `SafeFileSystemReader.read_data`: `load_bytes` gets each entry only after
    `torch.load(weights_only=True)` read it (re-saved, so the planner's own unrestricted load sees nothing else)."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except Exception as err:  # noqa: BLE001 - weights_only refused it (UnpicklingError) or it is no torch file
            refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            if refused:
                err = UnsafeDcpData(f"it refers to {refused.group(1)}, which torch.load(weights_only=True) refuses")
            file = self._reader.storage_data[read_item.storage_index].relative_path
            raise self._reader._refuse(_damaged(Path(self._reader.path), file, err, read_item.dest_index.fqn)) from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeFileSystemReader(FileSystemReader):
    """`torch.distributed.checkpoint.FileSystemReader` that never unpickles data from storage: `.metadata` through
    `read_dcp_metadata`, non-tensor entries through `torch.load(weights_only=True)` (tensors: torch's own
    `weights_only=True`). Use it wherever DCP reads a checkpoint: `dcp.load(state, storage_reader=...)`. Errors:
    DamagedCheckpointError (wrapped by DCP in a CheckpointException: `dcp_errors` unwraps it)."""

    refused: DamagedCheckpointError | None = None
    """The first file this reader refused (`dcp_errors` raises it), or None."""

    def _refuse(self, err: DamagedCheckpointError) -> DamagedCheckpointError:
        if self.refused is None:
            self.refused = err
        return err

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # vidray writes one global .metadata; DCP asks for a per-rank one after
            raise self.refused or DamagedCheckpointError(  # the global one failed
                f"DCP folder {self.path}: its {METADATA_FILE} cannot be read: use an earlier checkpoint",
                directory=str(self.path))
        try:
            metadata = read_dcp_metadata(Path(self.path) / METADATA_FILE)
        except DamagedCheckpointError as err:
            raise self._refuse(err) from None

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _SafeBytesPlanner(planner, self))


@contextlib.contextmanager
def dcp_errors(reader: SafeFileSystemReader) -> Iterator[None]:
    """Around a `dcp.load` through `reader`: when anything fails after `reader` refused a file, raise that
    DamagedCheckpointError itself (DCP swallows a failed `read_metadata` to try a per-rank one, and wraps each
    rank's failure in a CheckpointException, a BaseException); other failures pass unchanged."""
    try:
        yield
    except BaseException:
        if reader.refused is not None:
            raise reader.refused from None
        raise
