"""The checksum of swap-file blocks: CRC-32C, in hardware where the CPU has it.

A checksum is computed for every block written and read, so its cost is paid on every byte the
store moves; on a 2-core machine it competes with training for the same cores. CRC-32C with the
SSE4.2/ARMv8 instruction runs at about 8 GB/s per core here, zlib's CRC-32 at about 2.4 GB/s.
Both release the GIL. Swap files are scratch (read back only by the run that wrote them), so the
choice is made per process and only recorded in the index for a reader's information.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable

log = logging.getLogger(__name__)


def _choose() -> tuple[str, Callable[[memoryview | bytes], int]]:
    try:
        import crc32c
    except ImportError:
        why = "package crc32c missing"
    else:
        if crc32c.hardware_based:
            return "crc32c", crc32c.crc32c
        why = "software only"
    log.warning("no hardware CRC-32C here (%s); swap blocks are checked with zlib's crc32, which costs "
                "about 3x more CPU per byte", why)
    return "crc32", zlib.crc32


CHECKSUM_NAME, block_checksum = _choose()
"""`block_checksum(bytes-like) -> int`, unsigned 32 bits; `CHECKSUM_NAME` names the algorithm."""
