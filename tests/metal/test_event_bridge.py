"""The Metal host's event bridge (csrc/metal/host/event_bridge.cpp) runs here against a test
double of MTLSharedEvent, under ThreadSanitizer: handshakes cross in order, an abort unparks a
device wait, a failed command buffer's signals still reach the host, twins start at the host's
value (tests/metal/event_bridge_check.cpp)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shim_build import METAL, build_program

HERE = Path(__file__).resolve().parent


def test_event_bridge_logic_under_thread_sanitizer() -> None:
    exe = build_program(
        "event_bridge_check",
        [HERE / "event_bridge_check.cpp", METAL / "host" / "event_bridge.cpp"],
        ["-fsanitize=thread", "-g", "-O1"],
    )
    r = subprocess.run(
        [str(exe)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TSAN_OPTIONS": "halt_on_error=1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == 4 and "FAIL" not in r.stdout
