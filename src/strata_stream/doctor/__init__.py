"""`strata-stream doctor`: what this machine gives a streamed model.

`memory` says how much memory the process can have (a container's limit included) and how fast
it reads; `disk` measures the pack disk's read bandwidth at expert-record sizes and the engine's
IO thread counts; `saved` keeps the last measurement for `strata-stream plan`.
"""

from strata_stream.doctor.disk import DiskReading, measure_disk
from strata_stream.doctor.memory import MemoryReport, memory_bandwidth, memory_report
from strata_stream.doctor.saved import DoctorResult, load_result, result_path, save_result

__all__ = [
    "DiskReading",
    "DoctorResult",
    "MemoryReport",
    "load_result",
    "measure_disk",
    "memory_bandwidth",
    "memory_report",
    "result_path",
    "save_result",
]
