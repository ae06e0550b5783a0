"""Running a script on N local ranks with `mlx.launch --backend ring`, bounded in time.

For the tests and the benchmark on one machine: every rank on loopback, a free port range
picked first (so concurrent launches do not collide on mlx.launch's fixed default port), the
launcher in its own session so a timeout kills every rank with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def launcher() -> str | None:
    """The mlx.launch script next to this Python, or on PATH; None when absent."""
    beside = Path(sys.executable).with_name("mlx.launch")
    if beside.exists():
        return str(beside)
    return shutil.which("mlx.launch")


def free_port_range(n: int) -> int:
    """A port p with p..p+n-1 free on loopback now (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        ok = True
        for p in range(base + 1, base + n):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free range of loopback ports found")


def run_ranks(
    args: list[str],
    n: int = 2,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> LaunchResult:
    """`mlx.launch -n N --backend ring --python <this python> args...` on loopback.

    Kills the launcher's whole process group (every rank) on timeout."""
    exe = launcher()
    if exe is None:
        raise FileNotFoundError("mlx.launch not found (install mlx)")
    cmd = [exe, "-n", str(n), "--backend", "ring", "--python", sys.executable,
           "--starting-port", str(free_port_range(n)), *args]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return LaunchResult(proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return LaunchResult(-9, out, err, True)
    finally:
        if proc.poll() is None:  # pragma: no cover - interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


__all__ = ["LaunchResult", "free_port_range", "launcher", "run_ranks"]
