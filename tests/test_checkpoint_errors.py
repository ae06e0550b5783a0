"""A checkpoint that cannot be read as it is: one line naming the file and what to do.

Damaged safetensors files (cut short, garbage, unreadable), a checkpoint the chosen engine
cannot read (an mlx-lm quantized one under transformers; one a newer transformers saved, which
mlx-lm's model classes reject), arena sizes written with their unit, and an engine error in the
middle of the generated text.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from strata_stream.cli import main
from test_convert import _synthetic


def _one_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("strata-stream: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _damage(path: Path, how: str) -> None:
    weights = path / "model.safetensors"
    if how == "cut short":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif how == "garbage":
        weights.write_bytes(os.urandom(4096))
    else:  # unreadable: a directory in its place reads as no file at all, even for root
        weights.unlink()
        weights.mkdir()


ENGINES = [e for e, m in (("mlx-lm", "mlx_lm"), ("transformers", "transformers"))
           if importlib.util.find_spec(m) is not None]  # fmt: skip


@pytest.mark.parametrize("how", ["cut short", "garbage", "unreadable"])
def test_a_damaged_weights_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    ckpt = _synthetic(tmp_path / "m")
    _damage(ckpt, how)
    needle = f"{ckpt / 'model.safetensors'}: {'cannot be read' if how == 'unreadable' else ''}"
    assert main(["convert", str(ckpt)]) == 2
    _one_line(capsys, needle, "download or copy the model again")
    for engine in ENGINES:
        argv = ["generate", str(ckpt), "--prompt", "hi", "--engine", engine]
        assert main(argv) == 2, engine
        _one_line(capsys, needle, "download or copy the model again")


def test_an_mlx_lm_quantized_checkpoint_under_transformers_names_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")
    from mlx_models import make_checkpoint

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    model = make_checkpoint("qwen3_moe", tmp_path / "q4")
    argv = ["generate", str(model), "--prompt", "w1 w2", "--engine", "transformers"]
    assert main(argv) == 2
    _one_line(capsys, f"{model / 'config.json'}: an mlx-lm quantized checkpoint (4-bit, group 64)",
              "--engine mlx-lm")  # fmt: skip


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from strata_stream.transformers.random_model import make_checkpoint

    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("hf") / "model")


def test_a_checkpoint_mlx_lm_cannot_build_names_the_engine_or_runs_it(
    saved_by_transformers: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5 saves configs mlx-lm's ModelArgs reject: with --engine mlx-lm that is one
    line saying which engine reads it; without --engine that engine runs it, and says so."""
    pytest.importorskip("mlx_lm")
    import mlx_lm.utils

    model = saved_by_transformers
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    try:  # only where this mlx-lm does reject it
        mlx_lm.utils.load_model(model, lazy=True)
        pytest.skip("this mlx-lm builds the checkpoint transformers saved")
    except (TypeError, KeyError, ValueError, AttributeError):
        pass
    argv = ["generate", str(model), "--prompt", "w1 w2", "--max-tokens", "2"]
    assert main([*argv, "--engine", "mlx-lm"]) == 2
    _one_line(capsys, f"{model / 'config.json'}: mlx-lm cannot build this qwen3_moe model",
              "--engine transformers")  # fmt: skip
    assert main(argv) == 0
    got = capsys.readouterr()
    assert "running it with --engine transformers" in got.err
    assert "decode" in got.out


def test_arena_sizes_take_their_unit(
    saved_by_transformers: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from strata_stream import StreamConfig
    from strata_stream.errors import ConfigError
    from strata_stream.transformers import load

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    config = StreamConfig(io_threads=1, direct_io=False, persist_profile=False)
    # load() annotates arena_bytes as an int; a size with its unit is read too (arena_budget).
    size: Any = "2MiB"
    model = load(saved_by_transformers, arena_bytes=size, config=config, progress=False)
    try:
        slots = model.strata_engine.stream.n_slots
        stride = model.strata_engine.stream.record_stride
        assert slots == min((2 << 20) // stride, model.strata_engine.stream.n_layers
                            * model.strata_engine.stream.n_experts)  # fmt: skip
    finally:
        model.strata_engine.close()
    bad: Any
    for bad in ("lots", 2.5):
        with pytest.raises(ConfigError, match="arena_bytes"):
            load(saved_by_transformers, arena_bytes=bad, config=config, progress=False)
    argv = ["generate", str(saved_by_transformers), "--prompt", "w1", "--max-tokens", "1",
            "--engine", "transformers"]  # fmt: skip
    capsys.readouterr()  # the loads' progress
    assert main([*argv, "--arena-gb", "lots"]) == 2
    _one_line(capsys, "--arena-gb: cannot read 'lots' as a size")
    assert main([*argv, "--arena-gb", "1MiB"]) == 0
    assert "arena   1.00 MiB" in capsys.readouterr().out


def test_an_engine_error_mid_text_starts_its_own_line(
    saved_by_transformers: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers

    from strata_stream.errors import ExpertReadError

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    real = transformers.TextStreamer.put
    calls = 0

    def put(self: Any, value: Any) -> None:
        nonlocal calls
        calls += 1
        real(self, value)  # type: ignore[no-untyped-call]
        if calls == 3:
            self.on_finalized_text("half a wo")  # text printed, its line not ended
            raise ExpertReadError("expert read failed: EIO")

    monkeypatch.setattr(transformers.TextStreamer, "put", put)
    argv = ["generate", str(saved_by_transformers), "--prompt", "w1 w2", "--max-tokens", "4",
            "--engine", "transformers"]  # fmt: skip
    assert main(argv) == 2
    got = capsys.readouterr()
    assert "half a wo" in got.out and got.out.endswith("\n")
    assert got.err.endswith("\nstrata-stream: error: expert read failed: EIO\n")  # after progress


def test_damage_needs_no_engine_to_be_named(tmp_path: Path) -> None:
    """The check reads headers only: a whole checkpoint passes, whatever its size."""
    from strata_stream.paths import checked_model_dir, safetensors_problem

    ckpt = _synthetic(tmp_path / "m")
    assert checked_model_dir(ckpt) == ckpt
    assert safetensors_problem(ckpt / "model.safetensors") == ""
    shutil.copy(ckpt / "model.safetensors", tmp_path / "copy.safetensors")
    with open(tmp_path / "copy.safetensors", "ab") as f:
        f.write(b"\0" * 16)  # trailing bytes are no damage
    assert safetensors_problem(tmp_path / "copy.safetensors") == ""
