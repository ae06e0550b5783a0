"""strata-stream: run mixture-of-experts models bigger than memory by streaming their experts
from an SSD pack into a bounded arena.

    from strata_stream import ExpertPack, ExpertStream, StreamConfig
"""

from typing import TYPE_CHECKING, Any

from strata_stream import errors
from strata_stream.config import StreamConfig
from strata_stream.pack import ExpertPack, Geometry, write_pack
from strata_stream.stream import ExpertStream
from strata_stream.window import Window

if TYPE_CHECKING:
    from strata_stream._core import ReadClass, SlotState


def __getattr__(name: str) -> Any:
    # The extension's enums, imported on first use (see stream._core for what works without it).
    if name in ("ReadClass", "SlotState"):
        from strata_stream import stream

        return getattr(stream, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "ExpertPack",
    "ExpertStream",
    "Geometry",
    "ReadClass",
    "SlotState",
    "StreamConfig",
    "Window",
    "errors",
    "write_pack",
]
