"""/health's probe of the pack: can the file the engine streams experts from be read now?

A generation reads experts from the pack while it runs, so a pack that cannot be read (gone,
cut short, no longer permitted, its header overwritten) fails every generation that misses an
expert. /health reads a few bytes of it each time it is asked: the file opened afresh, its size
against the header's, its first bytes against what they were at start, and its last bytes.
That costs two small reads, and it answers for a server without traffic too. Damage inside
the records (which the engine's checksums catch) shows in the engine's last error instead
(serve/worker.py `ErrorRecord`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

HEAD_BYTES = 4096
TAIL_BYTES = 4096


class PackProbe:
    """probe() -> None when the pack reads as it did at start, else what is wrong (naming the
    file)."""

    def __init__(self, path: Path) -> None:
        from strata_stream.pack.reader import ExpertPack

        self.path = path
        with ExpertPack.open(path) as pack:
            self._size = pack.file_bytes
        self._head = self._read(0, min(HEAD_BYTES, self._size))

    def _read(self, offset: int, n: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self._size:
                raise OSError(f"it holds {size} bytes, not the {self._size} it was made with")
            data = os.pread(fd, n, offset)
            tail = os.pread(fd, TAIL_BYTES, max(0, self._size - TAIL_BYTES))
        finally:
            os.close(fd)
        if len(data) != n or len(tail) != min(TAIL_BYTES, self._size):
            raise OSError("a read came back short")
        return data

    def probe(self) -> str | None:
        try:
            head = self._read(0, len(self._head))
        except OSError as e:
            return f"the pack {self.path} cannot be read: {e.strerror or e}"
        if head != self._head:
            return f"the pack {self.path} changed since the server started: restart it"
        return None


def pack_probe(model: Any) -> PackProbe | None:
    """The probe of the pack `model` streams its experts from (None: it streams none)."""
    engine = getattr(model, "strata_engine", None)
    path = getattr(getattr(engine, "stream", None), "path", None)
    if path is None:
        return None
    return PackProbe(Path(path))


__all__ = ["PackProbe", "pack_probe"]
