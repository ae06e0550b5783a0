"""Routing traces: the file formats (``format``) and replay through the residency engine
(``replay``, which imports the engine, so it is not imported here)."""

from strata_stream.trace.format import Trace, read_trace, write_strata_trace

__all__ = ["Trace", "read_trace", "write_strata_trace"]
