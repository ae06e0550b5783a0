"""The exceptions strata-stream raises: one small hierarchy, each naming its cause.

Every error derives from `StrataError`; each also derives from the builtin a caller would
naturally catch (ValueError for bad input, OSError for IO), so generic handlers still work.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base of every strata-stream error."""


class ConfigError(StrataError, ValueError):
    """A configuration value, environment flag or arena size that cannot work."""


class PackError(StrataError, ValueError):
    """A pack file that is malformed: bad magic, version, metadata, size or checksum."""


class CheckpointError(StrataError, ValueError):
    """A model checkpoint that cannot be read as it is: a damaged or unreadable weights file, or
    a checkpoint the chosen engine cannot read. `engine` names the engine that can read it,
    where one can ("" otherwise)."""

    def __init__(self, message: str, engine: str = "") -> None:
        super().__init__(message)
        self.engine = engine


class ExpertReadError(StrataError, OSError):
    """An urgent expert read failed (EIO, short read, checksum); the stream stays usable."""


class StreamClosedError(StrataError, RuntimeError):
    """An operation on an ExpertStream (or Window) after close()."""


class ForkedError(StrataError, RuntimeError):
    """An ExpertStream or Window used in a process forked after it was opened: the engine's
    threads do not survive fork(), so the child must open the pack again itself."""


class StreamTimeoutError(StrataError, TimeoutError):
    """A bounded wait inside the engine ran out (a read that never finished)."""


class TurnError(StrataError, RuntimeError):
    """A Window layer call out of turn order (layers run 0..L-1, then 0 again)."""


class ArenaFullError(StrataError, RuntimeError):
    """An urgent request found no slot it may use: every slot is protected or in flight."""


class DeviceError(StrataError, RuntimeError):
    """The backend's device reported a fault (a CUDA error, or a kernel that met an expert the
    slot map did not publish): the Window call failed, its output is not to be used, and the
    stream and Window stay usable."""


__all__ = [
    "ArenaFullError",
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "ExpertReadError",
    "ForkedError",
    "PackError",
    "StrataError",
    "StreamClosedError",
    "StreamTimeoutError",
    "TurnError",
]
