"""The tests' checkpoints: strata_stream.mlx_lm.random_model (tiny by default), and a way to
spoil their expert tensors (to prove MLX never reads them)."""

import os
from pathlib import Path

from strata_stream.convert.safetensors_index import SafetensorsIndex
from strata_stream.mlx_lm.random_model import CONFIGS, make_checkpoint

__all__ = ["CONFIGS", "make_checkpoint", "poison_experts"]


def poison_experts(path: Path) -> None:
    """Overwrite every routed expert tensor in the shards with 0xFF bytes (NaN in bf16/f32).

    Each shard keeps its modification time: a pack converted before is still taken as this
    checkpoint's by the cheap check on load (sizes, mtimes, headers: convert/source.py), which
    is what lets the tests load the poisoned copy with the clean pack at all."""
    with SafetensorsIndex(path) as index:
        spans = [
            (t.file, t.offset, t.nbytes)
            for name, t in index.tensors.items()
            if (".switch_mlp." in name or ".experts." in name)
        ]
    assert spans
    times = {file: os.stat(file) for file, _, _ in spans}
    for file, offset, nbytes in spans:
        fd = os.open(file, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * nbytes, offset)
        finally:
            os.close(fd)
    for file, st in times.items():
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
