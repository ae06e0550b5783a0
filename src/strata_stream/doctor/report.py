"""`strata-stream doctor`: measure, save for plan, and print."""

from __future__ import annotations

from pathlib import Path

from strata_stream.doctor.disk import measure_disk
from strata_stream.doctor.memory import memory_bandwidth, memory_report
from strata_stream.doctor.saved import DoctorResult, save_result
from strata_stream.paths import cache_dir
from strata_stream.units import human_bytes


def run_doctor(path: str | None = None, progress: bool = True) -> tuple[DoctorResult, Path]:
    """Measures memory and the disk of `path` (default: the cache folder, where converted packs
    live), saves the result where plan reads it, and returns both."""
    folder = Path(path).expanduser() if path is not None else cache_dir()
    if path is None:
        folder.mkdir(parents=True, exist_ok=True)
    disk, notes = measure_disk(folder, progress=progress)
    result = DoctorResult(
        path=str(folder.resolve()),
        memory=memory_report(),
        memory_read_gbps=memory_bandwidth() / 1e9,
        disk=tuple(disk),
        notes=tuple(notes),
    )
    return result, save_result(result)


def _size(n: int | None) -> str:
    return "none" if n is None else f"{human_bytes(n)} ({n:,})"


def format_doctor(r: DoctorResult, saved: Path) -> str:
    m = r.memory
    lines = [
        f"memory total      {_size(m.total)}",
        f"memory available  {_size(m.available)}: what an arena sized from free memory starts from",
        f"container limit   {_size(m.container_limit)}"
        + ("" if m.container_left is None else f", {human_bytes(m.container_left)} left"),
        f"memory read       {r.memory_read_gbps:.1f} GB/s (every core)",
        f"disk              {r.path}",
        "  mode      record     threads   GB/s    lone record",
    ]
    for d in r.disk:
        lines.append(
            f"  {d.mode:<9} {human_bytes(d.record_bytes):<10} {d.threads:<9} {d.gbps:<7.2f} "
            f"{d.latency_s * 1e3:.3f} ms"
        )
    lines += [f"note              {n}" for n in r.notes]
    lines.append(f"saved             {saved} (strata-stream plan reads it)")
    return "\n".join(lines)


__all__ = ["format_doctor", "run_doctor"]
