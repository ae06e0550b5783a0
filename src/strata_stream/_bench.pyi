# Types of strata_stream._bench (benchmarks/native/bench_module.cpp): the native halves of
# benchmarks/kernels.py and benchmarks/io_bandwidth.py, not used by the library.
from typing import TypedDict

class KernelTiming(TypedDict):
    op: str
    seconds: float  # median over repeats
    flops: float  # floating-point operations of one run
    weight_bytes: float  # expert (or router) bytes one run reads

class RawRead(TypedDict):
    seconds: float
    bytes: int

def bench_kernels(
    path: str,
    *,
    layer: int,
    rows: int,
    repeats: int = 5,
    threads: int = 0,
    seed: int = 0,
    flush_bytes: int = 0,
) -> list[KernelTiming]: ...
def bench_read_bandwidth(bytes: int, *, threads: int = 0, repeats: int = 5) -> float: ...
def bench_raw_read(
    path: str,
    first: int,
    count: int,
    part_bytes: int,
    threads: int,
    dest_bytes: int,
    direct: bool = False,
    crc: bool = False,
) -> RawRead: ...
