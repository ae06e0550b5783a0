"""strata-stream: run mixture-of-experts models bigger than memory by streaming their experts
from an SSD pack into a bounded arena.

    from strata_stream import ExpertPack, ExpertStream, StreamConfig
"""

from strata_stream import errors
from strata_stream.config import StreamConfig
from strata_stream.pack import ExpertPack, Geometry, write_pack
from strata_stream.stream import ExpertStream, ReadClass, SlotState
from strata_stream.window import Window

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
