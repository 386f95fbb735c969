"""A frozen unit read where its weights lie: the spans of the model's files its flat buffer is made of.

A frozen unit (runtime/units.py [Note: frozen units]) whose every parameter is one stored tensor of
the weights files, as stored (not merged from several, not resized, not changed by an adapter's
initialization), rests on NVMe as a `FileSource` over those files (offload/file_source.py
[Note: read in place]): nothing copied at the start, the files' dtype read and converted on the
way in. `UnitSpans` describes the whole unit, whatever the world size: each rank cuts its shard from
it, a checkpoint records it (and each file's checksum) in place of the bytes, and a load or an
offline export reads the files again once their checksums match.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from outcore.offload.file_source import FileSource, FileSpan, FileStamp, WeightsFileChanged, file_checksum

log = logging.getLogger(__name__)

_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8)}
# Each file version's checksum as this process first computed it: the reference a later reading of
# its bytes must match (a file rewritten with its stamp put back keeps the stamp, not the bytes).
_reference: dict[tuple[str, FileStamp], str] = {}


@dataclass(frozen=True)
class UnitSpans:
    """Where each element of a unit's flat buffer lies in the weights files, and the stamps of
    those files taken when their headers were checked."""

    spans: tuple[FileSpan, ...]
    stamps: dict[str, FileStamp]

    def source(self, lo: int, hi: int) -> FileSource:
        """Elements [lo, hi) of the unit (a rank's shard; zeros past the parameters)."""
        parts = [p for s in self.spans if (p := s.part(lo, hi, lo)) is not None]
        return FileSource(parts, hi - lo, self.stamps)

    def as_json(self) -> list[dict]:
        return [{"file": s.path, "begin": s.begin, "dtype": str(s.dtype).removeprefix("torch."), "numel": s.numel,
                 "at": s.at} for s in self.spans]


def spans_from_json(entries: list[dict], stamps: dict[str, FileStamp]) -> UnitSpans:
    return UnitSpans(tuple(FileSpan(e["file"], int(e["begin"]), _DTYPES[e["dtype"]], int(e["numel"]), int(e["at"]))
                           for e in entries), stamps)


def checksums(stamps: dict[str, FileStamp]) -> dict[str, dict]:
    """Each file's size and checksum, as a checkpoint records them, computed from the bytes the file
    holds now (each file read whole at every save); WeightsFileChanged for a file that is not the one
    `stamps` says the run read, or whose bytes differ from those this process first checksummed."""
    out = {}
    for path, read in sorted(stamps.items()):
        stamp = FileStamp.of(path)
        why = read.differs(stamp)
        now = "" if why is not None else _fresh(path, stamp)
        if why is None and now != reference_checksum(path, stamp):
            why = "its bytes differ from those read at the start, though its size and modification time do not"
        if why is not None:
            raise WeightsFileChanged(f"weights file {path!r} changed during the run ({why}): a checkpoint would refer "
                                     "to other weights than the ones trained with. Put the original file back, or "
                                     "start again from the last checkpoint.")
        out[path] = {"size": stamp.size, "checksum": now}
    return out


def remember_checksums(stamps: dict[str, FileStamp]) -> None:
    """Checksum each file now, as the reference its later saves are held to (a run's start)."""
    for path, stamp in sorted(stamps.items()):
        reference_checksum(path, stamp)


def verified_stamps(files: dict[str, dict], where: str) -> dict[str, FileStamp]:
    """The stamps of the weights files a checkpoint refers to (`files`: meta.json's "weights_files"),
    once each is found to hold what it held when the checkpoint was written; else one ValueError
    naming the file and what differs."""
    stamps = {}
    for path, recorded in files.items():
        try:
            stamp = FileStamp.of(path)
        except OSError as e:
            raise ValueError(f"{where} reads frozen parameters from weights file {path!r}, which cannot be read "
                             f"({e.strerror}): put the model's weights back there.") from e
        ours = "" if stamp.size != recorded["size"] else reference_checksum(path, stamp)
        algorithm = recorded["checksum"].split(":", 1)[0]
        if ours and ours.split(":", 1)[0] != algorithm:  # whichever the cache held: compared as computed
            raise ValueError(f"the checkpoint's checksum of {path!r} is {algorithm}, which this machine does not "
                             "compute; install the crc32c package to match it.")
        if ours != recorded["checksum"]:
            raise ValueError(f"{where} reads frozen parameters from weights file {path!r}, which no longer holds what "
                             "it held when the checkpoint was written (size or checksum differ): put the original "
                             "weights back there.")
        stamps[path] = stamp
    return stamps


def reference_checksum(path: str, stamp: FileStamp) -> str:
    """`file_checksum(path)` as this process first computed it for this version (`stamp`) of the file."""
    key = (path, stamp)
    if key not in _reference:
        _reference[key] = _fresh(path, stamp)
    return _reference[key]


def _fresh(path: str, stamp: FileStamp) -> str:
    log.info("weights: checksumming %s (%.1f GB)", path, stamp.size / 1e9)
    return file_checksum(path)
