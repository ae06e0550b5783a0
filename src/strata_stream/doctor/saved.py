"""doctor's last measurement, kept in the cache folder for `strata-stream plan`."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from strata_stream.doctor.disk import DiskReading
from strata_stream.doctor.memory import MemoryReport
from strata_stream.paths import cache_dir

FORMAT = "strata-doctor v1"


@dataclass(frozen=True)
class DoctorResult:
    path: str  # the folder whose disk was measured
    memory: MemoryReport
    memory_read_gbps: float  # every core reading memory together (decimal GB/s)
    disk: tuple[DiskReading, ...]
    notes: tuple[str, ...] = ()
    measured_at: float = field(default_factory=time.time)  # seconds since the epoch

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "path": self.path,
            "measured_at": self.measured_at,
            "memory": asdict(self.memory),
            "memory_read_gbps": self.memory_read_gbps,
            "disk": [{**asdict(r), "gbps": r.gbps} for r in self.disk],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DoctorResult:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        disk = tuple(
            DiskReading(
                r["mode"],
                int(r["record_bytes"]),
                int(r["threads"]),
                int(r["bytes_read"]),
                float(r["seconds"]),
                float(r.get("latency_s", 0.0)),
            )
            for r in d["disk"]
        )
        return cls(
            str(d["path"]),
            MemoryReport(**d["memory"]),
            float(d["memory_read_gbps"]),
            disk,
            tuple(d.get("notes", ())),
            float(d["measured_at"]),
        )

    def disk_gbps(self, mode: str, record_bytes: int, threads: int) -> DiskReading | None:
        """The reading nearest what a stream of `record_bytes` records with `threads` IO threads
        does in `mode`: that mode, the thread count nearest, then the record size nearest (by
        ratio). None when the mode was not measured."""
        rows = [r for r in self.disk if r.mode == mode and r.bytes_read > 0]
        if not rows:
            return None
        return min(
            rows,
            key=lambda r: (
                abs(r.threads - threads),
                abs(math.log(r.record_bytes / max(1, record_bytes))),
            ),
        )


def result_path() -> Path:
    return cache_dir() / "doctor.json"


def save_result(result: DoctorResult) -> Path:
    """Written to a temporary and renamed: a reader never sees half a file."""
    path = result_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_result() -> DoctorResult | None:
    """The saved measurement; None where there is none or it cannot be read (an older format,
    a damaged file): plan then says the disk figure is assumed."""
    try:
        return DoctorResult.from_json(json.loads(result_path().read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


__all__ = ["DoctorResult", "load_result", "result_path", "save_result"]
