"""Where a conversion writes its pack before the pack appears under its name.

A pack is written into a private staging directory beside its destination,
``.NAME.<uuid>.staging``, and renamed onto ``NAME`` once complete. The uuid makes the name
unique across processes, PID namespaces (containers sharing a cache) and hosts (a cache on a
network file system), where a process id is not. The writer holds an exclusive ``flock`` on the
directory for as long as it writes; the kernel releases it when the writer exits or is killed,
so a staging directory nobody holds is a leftover of a dead writer and is removed
(`remove_leftovers`), while a live writer's, whatever namespace or host it runs in, is left
alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

_SUFFIX = ".staging"
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<id>[0-9a-f]{32})\.staging$")


def _held(directory: Path) -> int:
    """An fd of `directory` under this process's exclusive flock (blocking: nobody else takes
    it but a remover, which only tries)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """The path to write `out`'s content at; once the block ends without an exception, the file
    written there is renamed onto `out` (atomically: same directory). The staging directory is
    removed either way."""
    ident = uuid.uuid4().hex
    # Made under a name a remover does not match, locked, then renamed: a remover never finds
    # it unlocked while it is in use (the lock belongs to the directory, not its name).
    fresh = out.with_name(f".{out.name}.{ident}.new")
    fresh.mkdir()
    fd = -1
    try:
        fd = _held(fresh)
        directory = out.with_name(f".{out.name}.{ident}{_SUFFIX}")
        os.rename(fresh, directory)
        fresh = directory
        target = directory / out.name
        yield target
        os.replace(target, out)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        if fd >= 0:
            os.close(fd)


def remove_leftovers(directory: Path, name: str | None = None) -> list[Path]:
    """Removes the staging directories in `directory` (of files named `name`, or of any file
    when None) that no writer holds: what a killed conversion left, as large as the part of the
    pack it wrote. Returns what it removed."""
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _STAGING.match(entry.name)
        if m is None or (name is not None and m["name"] != name):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue  # gone already, or not a directory
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


def unique_temporary(path: Path) -> Path:
    """A hidden name beside `path` for a small file written then renamed onto it, unique across
    processes, namespaces and hosts."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


__all__ = ["remove_leftovers", "staged", "unique_temporary"]
