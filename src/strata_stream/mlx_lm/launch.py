"""Running a script on N local ranks with `mlx.launch --backend ring`, bounded in time.

For the tests and the benchmark on one machine: every rank on loopback, a free port range
picked first (so concurrent launches do not collide on mlx.launch's fixed default port), the
launcher in its own session so a timeout kills every rank with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_RANK_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


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


def start_ranks(
    args: list[str], n: int = 2, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.Popen[str]:
    """`mlx.launch` as run_ranks does, without waiting (a server); output to pipes. Stop it
    with `kill_ranks`."""
    exe = launcher()
    if exe is None:
        raise FileNotFoundError("mlx.launch not found (install mlx)")
    cmd = [exe, "-n", str(n), "--backend", "ring", "--python", sys.executable,
           "--starting-port", str(free_port_range(n)), *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})},
                            cwd=cwd)  # fmt: skip


def rank_pids(launch: subprocess.Popen[str]) -> dict[int, int]:
    """MLX rank -> pid of the ranks a `start_ranks` launch runs on this machine (Linux /proc:
    the processes of the launch's session whose environment has MLX_RANK)."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != launch.pid:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if not cmdline.startswith(sys.executable.encode()):
            continue  # the shells mlx.launch starts each rank with
        for var in env:
            if var.startswith(b"MLX_RANK="):
                out[int(var[len(b"MLX_RANK=") :])] = int(entry.name)
    return out


def kill_ranks(launch: subprocess.Popen[str]) -> None:
    """Kills every process of a launch (its session's process group) and reaps the launcher."""
    if launch.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
    launch.communicate()


def run_ranks(
    args: list[str],
    n: int = 2,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> LaunchResult:
    """`mlx.launch -n N --backend ring --python <this python> args...` on loopback.

    n == 1 runs `python args...` directly: mlx.launch writes an empty hostfile for one rank,
    which the ring backend cannot parse, and a single process is MLX's singleton group anyway.
    mlx.launch exits 0 even when a rank fails (it only warns "Node with rank R exited with code
    C"), so such a warning's code becomes the result's returncode. Kills the launcher's whole
    process group (every rank) on timeout."""
    if n == 1:
        cmd = [sys.executable, *args]
    else:
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
        code = proc.returncode
        for m in _RANK_EXIT.finditer(out + err):
            if code == 0 and int(m.group(2)) != 0:
                code = int(m.group(2))
        return LaunchResult(code, out, err, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return LaunchResult(-9, out, err, True)
    finally:
        if proc.poll() is None:  # pragma: no cover - interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


__all__ = [
    "LaunchResult",
    "free_port_range",
    "kill_ranks",
    "launcher",
    "rank_pids",
    "run_ranks",
    "start_ranks",
]
