"""strata_stream.process_memory: a child's peak is its own, and the readings add up."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import time

import numpy as np
import pytest

from strata_stream.process_memory import (
    PeakSampler,
    mapped_file_bytes,
    memory_status,
    resident_bytes,
)

linux_only = pytest.mark.skipif(memory_status() is None, reason="needs /proc (Linux)")

_BIG = 384 << 20

# A parent that touches _BIG bytes, frees them, then starts a child that reports its own peak
# through memory_status and through getrusage's ru_maxrss.
_PARENT = f"""
import json, subprocess, sys
from strata_stream.process_memory import memory_status
big = b"\\x01" * {_BIG}
del big
parent = memory_status().peak
child = subprocess.run([sys.executable, "-c", '''
import json, resource
from strata_stream.process_memory import memory_status
print(json.dumps([memory_status().peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))
'''], capture_output=True, text=True, check=True).stdout
print(json.dumps([parent, *json.loads(child)]))
"""


@linux_only
def test_a_child_started_by_a_parent_that_peaked_reports_its_own_peak() -> None:
    """What benchmarks/mlx_lm_e2e.py got wrong: a child's ru_maxrss is (on Linux) the peak of
    the parent it was forked from, VmHWM is the child's own."""
    run = subprocess.run([sys.executable, "-c", _PARENT], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    parent, child, child_maxrss_kib = json.loads(run.stdout.strip().splitlines()[-1])
    assert parent >= _BIG
    # A bare interpreter holds a few tens of MB; the parent's peak was hundreds above that.
    assert child < parent - _BIG // 2, (parent, child, child_maxrss_kib * 1024)


@linux_only
def test_resident_bytes_counts_touched_pages_only() -> None:
    region = mmap.mmap(-1, 16 << 20)  # a fresh anonymous mapping: nothing faulted in yet
    view = np.frombuffer(region, np.uint8)
    try:
        address = view.ctypes.data
        assert resident_bytes(address, view.nbytes) == 0
        view[: 8 << 20] = 1
        assert 8 << 20 <= resident_bytes(address, view.nbytes) < view.nbytes
        assert resident_bytes(address, 8 << 20) == 8 << 20
        view[:] = 1
        assert resident_bytes(address, view.nbytes) == view.nbytes
    finally:
        del view
        region.close()


@linux_only
def test_status_adds_up_and_names_mapped_libraries() -> None:
    s = memory_status()
    assert s is not None
    assert s.resident == s.anonymous + s.file_backed + s.shared
    assert s.peak >= s.resident
    # This interpreter maps shared libraries (numpy's, at least): file-backed, resident.
    assert 0 < mapped_file_bytes((".so",)) <= s.file_backed


@linux_only
def test_the_sampler_sees_a_child_grow() -> None:
    code = "import time\nbig = b'\\x01' * (64 << 20)\ntime.sleep(0.5)\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    with PeakSampler(proc.pid, interval=0.01) as sampler:
        proc.wait(timeout=60)
        time.sleep(0.02)
    assert proc.returncode == 0
    assert sampler.samples > 0 and sampler.at_peak is not None
    assert sampler.at_peak.anonymous >= 64 << 20
