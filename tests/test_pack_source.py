"""A pack knows which weights it was made from (convert/source.py, convert/pack_cache.py).

- a checkpoint rebuilt in place (same path, config and sizes, so the same cache entry) gets its
  pack converted again, and the streamed output is plain mlx-lm's on the new weights;
- a pack of another model of the same geometry is refused, naming the tensor and the shard;
- a checkpoint only touched (new mtimes, same bytes) keeps its pack, checked by digest once;
- two processes loading one model convert it once; a killed conversion's temporary is removed
  by the next run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import strata_stream
from strata_stream.convert import convert
from strata_stream.convert import source as source_mod
from strata_stream.convert.pack_cache import default_pack_path, ensure_pack, stale_reason
from strata_stream.convert.share import WHOLE
from strata_stream.errors import PackError
from strata_stream.pack import ExpertPack
from test_convert import _synthetic


def _rebuild(path: Path, seed: int) -> None:
    """The same checkpoint layout with other random expert bytes, written in place."""
    before = {f.name: f.stat().st_size for f in path.glob("*.safetensors")}
    config = (path / "config.json").read_bytes()
    import shutil

    tmp = path.with_name(path.name + ".new")
    _synthetic(tmp, seed=seed)
    shutil.copyfile(tmp / "model.safetensors", path / "model.safetensors")
    assert {f.name: f.stat().st_size for f in path.glob("*.safetensors")} == before
    assert (path / "config.json").read_bytes() == config


def test_the_pack_records_its_source(tmp_path: Path) -> None:
    ckpt = _synthetic(tmp_path / "m")
    pack = convert(ckpt, tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        record = p.metadata["model"]["source_weights"]
    (shard,) = record["shards"]
    assert shard["name"] == "model.safetensors"
    assert shard["bytes"] == (ckpt / "model.safetensors").stat().st_size
    digests, _ = source_mod.expert_digests(ckpt, WHOLE)
    assert record["tensors"] == digests and len(digests) == 2 * 3 * 3  # layers x mats x roles
    assert set(digests.values()) != {"0" * 64}
    assert stale_reason(pack, ckpt) is None


def test_a_rebuilt_checkpoint_is_not_its_old_pack(tmp_path: Path) -> None:
    ckpt = _synthetic(tmp_path / "m")
    pack = convert(ckpt, tmp_path / "m.strpk", progress=False)
    _rebuild(ckpt, seed=1)
    reason = stale_reason(pack, ckpt)
    assert reason is not None and "model.layers.0.mlp.switch_mlp" in reason
    assert "(in model.safetensors) holds other bytes" in reason
    with pytest.raises(PackError, match=r"m\.strpk was not made from the weights in .*holds other"):
        ensure_pack(ckpt, pack, progress=False)


def test_a_touched_checkpoint_keeps_its_pack_checked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _synthetic(tmp_path / "m")
    pack = convert(ckpt, tmp_path / "m.strpk", progress=False)
    os.utime(ckpt / "model.safetensors", ns=(1, 1))
    assert ensure_pack(ckpt, pack, progress=False) == pack  # digests equal: accepted
    assert (tmp_path / "m.strpk.source.json").exists()

    def fail(*a: object) -> None:
        raise AssertionError("the digests were read again")

    monkeypatch.setattr(source_mod, "expert_digests", fail)
    assert ensure_pack(ckpt, pack, progress=False) == pack  # the confirmed mtimes: cheap


def test_the_cache_converts_a_changed_checkpoint_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    ckpt = _synthetic(tmp_path / "m")
    first = ensure_pack(ckpt, progress=False)
    assert first == default_pack_path(ckpt)
    made = first.stat().st_mtime_ns
    assert ensure_pack(ckpt, progress=False) == first and first.stat().st_mtime_ns == made
    _rebuild(ckpt, seed=1)
    assert default_pack_path(ckpt) == first  # the same cache entry: its name cannot tell
    again = ensure_pack(ckpt, progress=False)
    assert again == first and again.stat().st_mtime_ns != made
    assert stale_reason(again, ckpt) is None


_SLOW_CONVERT = """
import sys, time
from pathlib import Path
from strata_stream.convert import checkpoint
from strata_stream.convert.share import WHOLE
from strata_stream.convert.pack_cache import ensure_pack

slow = float(sys.argv[3])
real = checkpoint.ExpertLayout.experts_fn
def experts_fn(self, index, digests=None):
    inner = real(self, index, digests)
    def experts(layer, e):
        time.sleep(slow)
        return inner(layer, e)
    return experts
checkpoint.ExpertLayout.experts_fn = experts_fn
import strata_stream.convert.pack_cache as cache
real_convert = cache.convert
def convert(*a, **k):
    print("converting", flush=True)
    return real_convert(*a, **k)
cache.convert = convert
out = None if sys.argv[2] == "-" else sys.argv[2]
print(ensure_pack(Path(sys.argv[1]), out, progress=False), flush=True)
"""


def _child_path() -> str:
    """The children import the strata_stream this process imported (an editable checkout, or
    an install elsewhere such as pip --target), and keep the rest of its PYTHONPATH."""
    here = str(Path(strata_stream.__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)


def _converter(ckpt: Path, out: str, slow: float, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, str(ckpt), out, str(slow)],
        env={**os.environ, **env, "PYTHONPATH": _child_path()},
        stdout=subprocess.PIPE,
        text=True,
    )


def test_two_processes_convert_a_model_once(tmp_path: Path) -> None:
    ckpt = _synthetic(tmp_path / "m")
    env = {"STRATA_CACHE": str(tmp_path / "cache")}
    procs = [_converter(ckpt, "-", 0.02, env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(out.count("converting") for out in outs) == 1
    paths = {out.splitlines()[-1] for out in outs}
    assert len(paths) == 1
    assert stale_reason(Path(paths.pop()), ckpt) is None


@pytest.mark.parametrize("where", ["out", "cache"])
def test_a_killed_conversion_leaves_nothing_after_the_next_run(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _synthetic(tmp_path / "m")
    env = {"STRATA_CACHE": str(tmp_path / "cache")}
    monkeypatch.setenv("STRATA_CACHE", env["STRATA_CACHE"])
    out = tmp_path / "out.strpk"
    proc = _converter(ckpt, str(out) if where == "out" else "-", 0.5, env)
    folder = tmp_path if where == "out" else tmp_path / "cache" / "packs"
    deadline = time.monotonic() + 60
    # The pack being written, in the writer's staging directory (pack/staging.py).
    while not list(folder.glob(".*.staging/*")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (left,) = folder.glob(".*.staging")
    assert sum(f.stat().st_size for f in left.iterdir()) > 0
    again = _converter(ckpt, str(out) if where == "out" else "-", 0.0, env)
    assert again.communicate(timeout=120)[0] and again.returncode == 0
    assert list(folder.glob(".*.staging")) == [] and list(folder.glob(".*.tmp")) == []
    made = out if where == "out" else default_pack_path(ckpt)
    assert stale_reason(made, ckpt) is None
    assert np.array_equal(np.fromfile(made, np.uint8, 8), np.frombuffer(b"STRATAPK", np.uint8))


def test_streamed_output_follows_a_model_rebuilt_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new user's case: the same path, config and file sizes, other weights. The cache entry
    is the same, its pack is stale, and the streamed model must still be plain mlx-lm's."""
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_models import make_checkpoint
    from strata_stream import StreamConfig
    from strata_stream.mlx_lm import load

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    config = StreamConfig(io_threads=1, direct_io=False, persist_profile=False)
    prompt = mx.array([[5, 9, 12, 3, 40, 22, 7]])
    path = tmp_path / "model"

    def streamed_and_plain() -> tuple[np.ndarray, np.ndarray]:
        model, _ = load(str(path), arena_bytes=1 << 24, config=config, progress=False)
        try:
            got = np.array(model(prompt).astype(mx.float32))
        finally:
            model.strata_engine.close()
        ref, _ = mlx_lm.load(str(path))
        return got, np.array(ref(prompt).astype(mx.float32))

    make_checkpoint("qwen3_moe", path, seed=0)
    sizes = {f.name: f.stat().st_size for f in path.glob("*.safetensors")}
    got, want = streamed_and_plain()
    assert np.array_equal(got, want)
    entry = default_pack_path(path)
    old = tmp_path / "old.strpk"
    os.link(entry, old)  # keep the first pack for the --pack case below

    make_checkpoint("qwen3_moe", path, seed=1)
    assert {f.name: f.stat().st_size for f in path.glob("*.safetensors")} == sizes
    assert default_pack_path(path) == entry
    got2, want2 = streamed_and_plain()
    assert not np.array_equal(want2, want)  # other weights, other logits
    assert np.array_equal(got2, want2)

    # A pack of another model of the same geometry, named explicitly: refused, not used.
    with pytest.raises(PackError, match=r"old\.strpk was not made from the weights in .*model"):
        load(str(path), pack_path=old, arena_bytes=1 << 24, config=config, progress=False)
