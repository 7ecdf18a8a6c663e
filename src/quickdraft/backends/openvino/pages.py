"""Give back the pages of an export's weight file once the CPU plugin holds its own copy.

The CPU plugin memory-maps the IR's ``.bin`` file, builds its own packed copy of every weight
(anonymous memory) at the first inference, and keeps the file mapped although inference reads the
packed copy. Every page of the file it touched while packing stays in the process's resident set,
so peak and steady RSS come to about twice the weights (docs/openvino.md, Memory).

:class:`WeightPages` drops those pages from the process with ``madvise(MADV_DONTNEED)`` on the
file's read-only mappings (``/proc/self/maps``). The mapping stays valid: a page read again is
faulted back in from the file (or the page cache), so results cannot change; a read-only private
mapping holds no private data to lose. :meth:`WeightPages.shedding` does it every few milliseconds
while a block runs (loading and the first inference), so the file's pages never pile up beside the
packed copy. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def read_only_mappings(files: Iterable[str], maps: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the mappings of ``files`` without write permission in a ``/proc/<pid>/maps`` text.

    >>> text = "7f00-7f10 r--p 00000000 08:01 5 /m/a.bin\\n7f10-7f20 rw-p 00000000 08:01 5 /m/a.bin\\n"
    >>> read_only_mappings(["/m/a.bin"], text)
    [(32512, 32528)]
    """
    wanted = set(files)
    out = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] in wanted and "w" not in parts[1]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out


class WeightPages:
    """The weight files (``*.bin``) of one OpenVINO export, as mapped into this process."""

    def __init__(self, export_dir: str | os.PathLike[str]) -> None:
        self.files = sorted(str(p.resolve()) for p in Path(export_dir).glob("*.bin"))
        self._madvise = _madvise()
        self.released_bytes = 0  # bytes of mappings advised, summed over calls

    def release(self) -> int:
        """Drop the files' resident pages from this process; returns the bytes of mappings advised."""
        if self._madvise is None or not self.files:
            return 0
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return 0
        done = 0
        for start, end in read_only_mappings(self.files, maps):
            if self._madvise(start, end - start, MADV_DONTNEED) == 0:
                done += end - start
        self.released_bytes += done
        return done

    @contextmanager
    def shedding(self, interval: float = 0.02) -> Iterator["WeightPages"]:
        """Release the pages every ``interval`` seconds while the block runs, and once after it."""
        if self._madvise is None or not self.files:
            yield self
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                self.release()

        thread = threading.Thread(target=loop, name="quickdraft-weight-pages", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.release()
