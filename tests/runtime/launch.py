"""Start N real ranks under torchrun, its logs kept in the test's own directory."""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(world: int, tmp_path: str | os.PathLike[str]) -> list[str]:
    """The launcher's argv up to the script. `--log-dir` keeps torchrun from leaving a
    `torchelastic_*` directory in the system's temporary directory for every launch."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", f"--log-dir={os.path.join(tmp_path, 'torchrun')}"]
