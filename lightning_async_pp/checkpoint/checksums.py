"""A checkpoint's files checked before they are read (docs/design/checkpoints.md, "Checksums"): each file of a
sharded checkpoint against the CRC-32 recorded at its save (``checksums.json``, written by
:class:`ChecksummedWriter`), a sharded directory for missing and short files, a single file for the CRC-32 that
``torch.save`` records of each of its records."""
from __future__ import annotations

import json
import os
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_async_pp.checkpoint.format import CHECKSUMS_FILE, META_FILE, UnreadableCheckpoint, _first_line

_CHUNK = 8 << 20

def file_crc32(path: str | os.PathLike) -> str:
    """The CRC-32 of the file ``path`` as 8 hex digits (zlib's: about 4x as fast as blake2b here, BENCHMARKS.md;
    it is against damage, not tampering)."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"

def _manifest_crc(files: Mapping[str, str]) -> str:
    return f"{zlib.crc32(json.dumps(dict(files), sort_keys=True).encode()):08x}"

def read_checksums(path: str) -> Optional[dict[str, str]]:
    """The CRC-32 of each file that the sharded checkpoint ``path`` recorded at its save (``None`` where it recorded
    none: one written before checksums were). The list carries its own checksum, so damage to it is named as such."""
    manifest = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.isfile(manifest):
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            saved = json.load(f)
        files = {str(k): str(v) for k, v in saved["files"].items()}
        intact = saved["algorithm"] == "crc32" and saved["self"] == _manifest_crc(files)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UnreadableCheckpoint(manifest, f"its list of the files' checksums cannot be read ({_first_line(err)}): "
                                   "it is damaged") from err
    if not intact:
        raise UnreadableCheckpoint(manifest, "its list of the files' checksums fails its own checksum: it is damaged")
    return files

def verify_file(path: str, relative: str, checksums: Mapping[str, str]) -> None:
    """Refuse the file ``relative`` of the sharded checkpoint ``path`` if it no longer has the CRC-32 recorded at its
    save (a file the list does not name is not checked)."""
    expected = checksums.get(relative)
    if expected is None:
        return
    file = os.path.join(path, relative)
    if not os.path.isfile(file):
        raise UnreadableCheckpoint(file, f"the file is missing ({CHECKSUMS_FILE} lists it)")
    found = file_crc32(file)
    if found != expected:
        raise UnreadableCheckpoint(file, f"its CRC-32 is {found}, but {CHECKSUMS_FILE} recorded {expected} when it was "
                                   f"saved: the file changed since (a flipped bit on the disk or in a copy), it is "
                                   f"damaged")

class _FileSums(dict):
    """The CRC-32 of the shard files one process wrote, carried to the coordinator among its write results."""

class ChecksummedWriter(dcp.FileSystemWriter):
    """``torch.distributed.checkpoint``'s file writer, which also records each file's CRC-32 in
    ``checksums.json``: every process hashes the shards it wrote, inside DCP's write (an async save's background
    thread), the coordinator receives them with the write results and, after ``.metadata``, writes the list with
    the checksums of ``.metadata`` and ``meta.pt`` (written before the save). All of it is inside the temporary
    directory, put in place only when complete."""

    def write_data(self, plan: Any, planner: Any) -> Future:
        written = super().write_data(plan, planner)
        written.wait()
        results = list(written.value())
        sums = _FileSums({name: file_crc32(os.path.join(self.path, name))
                          for name in {r.storage_data.relative_path for r in results}})
        future: Future = Future()
        future.set_result([*results, sums])
        return future

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        files: dict[str, str] = {}
        for part in results:
            for r in part:
                if isinstance(r, _FileSums):
                    files.update(r)
        super().finish(metadata, [[r for r in part if isinstance(r, WriteResult)] for part in results])
        for name in (".metadata", META_FILE):
            if os.path.isfile(os.path.join(self.path, name)):
                files[name] = file_crc32(os.path.join(self.path, name))
        with open(os.path.join(self.path, CHECKSUMS_FILE), "w", encoding="utf-8") as f:
            json.dump({"algorithm": "crc32", "files": dict(sorted(files.items())), "self": _manifest_crc(files)}, f,
                      indent=1)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())

class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader, which first checks each shard file this process's plan reads against its checksum (those
    in ``verified`` passed already). In DCP's read step, so that its gather of each process's outcome carries the
    refusal to every process."""

    def __init__(self, path: str, checksums: Mapping[str, str], verified: set[str]) -> None:
        super().__init__(path)
        self.root, self.checksums, self.verified = path, checksums, verified

    def read_data(self, plan: Any, planner: Any) -> Future:
        for relative in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}
                               - self.verified):
            verify_file(self.root, relative, self.checksums)
            self.verified.add(relative)
        return super().read_data(plan, planner)


# ---- before anything is read: every file there, long enough and intact -------------------------------------------
def check_sharded(path: str) -> Any:
    """The ``torch.distributed.checkpoint`` metadata of the sharded checkpoint directory ``path``, once every file it
    needs is there and long enough: ``.metadata`` (and its checksum), ``meta.pt`` and each shard up to the last byte
    the metadata places in it. A :class:`UnreadableCheckpoint` names the first file that is missing, cut short or
    damaged. A checkpoint without checksums (written by an earlier version) is read unchecked, with a warning."""
    index = os.path.join(path, ".metadata")
    if not os.path.isfile(index):
        raise UnreadableCheckpoint(path, "the directory has no .metadata (torch.distributed.checkpoint's index of the "
                                   "shards), so it is not a sharded checkpoint or its save never finished")
    checksums = read_checksums(path)
    if checksums is None:
        warnings.warn(f"the checkpoint {path!r} has no {CHECKSUMS_FILE} (it was written before lightning-async-pp "
                      f"recorded checksums, or by torch.distributed.checkpoint directly): its files are read without "
                      f"checking that they are intact", stacklevel=2)
    else:
        verify_file(path, ".metadata", checksums)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise UnreadableCheckpoint(index, f"torch.distributed.checkpoint cannot read it ({_first_line(err)})") from err
    if not os.path.isfile(os.path.join(path, META_FILE)):
        raise UnreadableCheckpoint(path, f"the directory has no {META_FILE} (the loops' and callbacks' state)")
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if relative is not None:
            ends[relative] = max(ends.get(relative, 0), end)
    for relative, end in sorted(ends.items()):
        shard = os.path.join(path, relative)
        if not os.path.isfile(shard):
            raise UnreadableCheckpoint(shard, "the shard is missing (.metadata places tensors in it)")
        size = os.path.getsize(shard)
        if size < end:
            raise UnreadableCheckpoint(shard, f"the shard is {size} bytes, but .metadata places tensors in it up to "
                                       f"byte {end}: it was cut short")
    return metadata

def check_file(path: str) -> None:
    """Refuse, before ``torch.load`` reads it, a checkpoint file that is not a ``torch.save`` archive (a zip file with
    its index at the end): one cut short, or not a checkpoint at all; and one whose records fail the CRC-32 that
    ``torch.save`` wrote for each (``torch.load`` does not check them): a damaged file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if not _ends_with_zip_index(path):
        raise UnreadableCheckpoint(path, f"it is not a torch.save archive ({os.path.getsize(path)} bytes without the "
                                   "zip index torch.save writes at its end): it was cut short (a copy or a save "
                                   "interrupted, a full disk), or it is not a checkpoint")
    _check_records(path)

def _check_records(path: str) -> None:
    """Read each record of the ``torch.save`` archive ``path`` through :mod:`zipfile`, which checks its CRC-32 at
    its end. A record whose recorded CRC is 0 is not checked: ``torch.save`` writes 0 when
    ``torch.utils.serialization.config.save.compute_crc32`` is off."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                with archive.open(info) as record:
                    while record.read(_CHUNK):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise UnreadableCheckpoint(path, f"it fails the checks of its zip records ({err}): it is damaged (it changed "
                                   f"since torch.save wrote it: a flipped bit on the disk or in a copy)") from err

def _ends_with_zip_index(path: str) -> bool:
    """Whether the file ends with a zip archive's end record, as every ``torch.save`` file does (it writes no
    archive comment). A file cut short may still hold such records of archives saved inside it (the optimizer
    settings are ``torch.save`` bytes), so only the file's last 22 bytes count."""
    size = os.path.getsize(path)
    if size < 22:
        return False
    with open(path, "rb") as f:
        f.seek(size - 22)
        return f.read(4) == b"PK\x05\x06"
