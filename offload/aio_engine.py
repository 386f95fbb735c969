"""The aiofiles backend: the same contract as `ThreadIOEngine`, driven by an asyncio loop.

Offered for asyncio callers and as a reference in `outcore bench-disk`. aiofiles runs each file
call in the loop's executor, so every block costs a seek and a readinto/write hop through that
pool; each concurrent block needs its own file object (they would share one file offset).
"""

from __future__ import annotations

import asyncio
import os
import threading

import aiofiles
import numpy as np

from outcore.offload.background import background_pool, lower_priority
from outcore.offload.checksum import block_checksum
from outcore.offload.io_config import IOConfig
from outcore.offload.io_engine import Finalizer, IOCounters, IOEngine, IOFile, IOHandle, ShortIOError


class AiofilesIOEngine(IOEngine):
    """Blocks of a request run as coroutines, at most `queue_depth` at once, over `threads` workers."""

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self.counters = IOCounters()
        self._executor = background_pool(config.threads, "outcore-aio", config.nice)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._run_loop, name="outcore-aio-loop", daemon=True)
        self._thread.start()
        self._files: dict[str, asyncio.Queue] = {}  # path -> idle aiofiles objects (loop thread only)
        self._opened: list = []
        self._slots = asyncio.Semaphore(config.queue_depth)  # used in the loop thread only

    def _run_loop(self) -> None:
        lower_priority(self.config.nice)
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close_files(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._executor.shutdown()

    def _submit(self, write: bool, file: IOFile, offset: int, array: np.ndarray, checksum: bool,
                finalize: Finalizer | None) -> IOHandle:
        bs = self.config.block_size
        handle = IOHandle(-(-len(array) // bs), len(array), finalize)
        if len(array):
            view = memoryview(array)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
            coro = self._request(handle, write, file, offset, view, checksum)
            asyncio.run_coroutine_threadsafe(coro, self._loop)
        return handle

    async def _request(self, handle: IOHandle, write: bool, file: IOFile, offset: int, view: memoryview,
                       checksum: bool) -> None:
        bs = self.config.block_size
        blocks = [self._block(handle, i, write, file, offset + s, view[s : s + bs], checksum)
                  for i, s in enumerate(range(0, len(view), bs))]
        await asyncio.gather(*blocks)

    async def _block(self, handle: IOHandle, index: int, write: bool, file: IOFile, offset: int,
                     view: memoryview, checksum: bool) -> None:
        crc, error = 0, None
        async with self._slots:
            f = await self._checkout(file)
            try:
                if write and checksum:
                    crc = await self._loop.run_in_executor(None, block_checksum, view)
                self.counters.begin()
                try:
                    await self._move(f, write, offset, view)
                finally:
                    self.counters.end(len(view), write)
                if checksum and not write:
                    crc = await self._loop.run_in_executor(None, block_checksum, view)
            except OSError as e:
                error = e
            finally:
                self._files[file.path].put_nowait(f)
        handle.block_done(index, crc, error)

    @staticmethod
    async def _move(f, write: bool, offset: int, view: memoryview) -> None:
        await f.seek(offset)
        done = 0
        while done < len(view):
            n = await (f.write(view[done:]) if write else f.readinto(view[done:]))
            if not n:
                raise ShortIOError(f"write at {offset + done:,} made no progress" if write else
                                   f"file ends at {offset + done:,}, {len(view) - done:,} bytes short")
            done += n

    async def _checkout(self, file: IOFile):
        idle = self._files.get(file.path)
        if idle is None:
            idle = self._files[file.path] = asyncio.Queue()
            for _ in range(self.config.queue_depth):
                direct = file.direct
                f = await aiofiles.open(file.path, "r+b", buffering=0,
                                        opener=lambda p, fl, d=direct: os.open(p, fl | (os.O_DIRECT if d else 0)))
                self._opened.append(f)
                idle.put_nowait(f)
        return await idle.get()

    async def _close_files(self) -> None:
        for f in self._opened:
            await f.close()

