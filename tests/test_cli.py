"""The `strata-stream` CLI, driven through main(argv) return codes."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from strata_stream.cli import main


def test_pack_inspect_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.strpk"
    assert main(["pack", "--synthetic", "tiny", str(out), "--quiet"]) == 0
    assert out.exists() and f"wrote {out}" in capsys.readouterr().out

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 layers x 16 experts, top-4, hidden 64, moe_intermediate 32" in text
    assert "weight format  f16\n" in text
    assert "64 x 12,288 bytes (stride 16,384)" in text
    assert f"file size      {out.stat().st_size:,} bytes" in text
    assert "down weight  f16  [64, 32]" in text

    assert main(["verify", str(out)]) == 0  # with the progress bar (on stderr)
    assert capsys.readouterr().out == "ok: 64 records\n"


def test_pack_format_and_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.strpk"
    args = ["pack", "--synthetic", "tiny", str(out), "--format", "q4", "--seed", "3", "--quiet"]
    assert main(args) == 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "weight format  q4, group_size 32, scales f16" in text
    assert "synthetic preset tiny (seed 3)" in text


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.strpk"
    assert main(["inspect", str(missing)]) == 2
    assert main(["verify", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("strata-stream: error: ") == 2 and err.count("\n") == 2
    assert "No such file" in err and "Traceback" not in err
    assert main(["pack", "--synthetic", "tiny", str(tmp_path / "no" / "dir" / "x"), "--quiet"]) == 2


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for argv in (
        [],
        ["pack", "--synthetic", "nope", str(tmp_path / "x")],
        ["pack", str(tmp_path / "x")],
        ["inspect", "a", "b"],
        ["pack", "--synthetic", "tiny", str(tmp_path / "x"), "--format", "int3"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_demo_is_lazy_and_gets_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    demo = types.ModuleType("strata_stream.demo")
    demo.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "strata_stream.demo", demo)
    assert main(["demo", "--synthetic", "--layers", "4", "--help"]) == 7
    assert main(["demo", "--synthetic"]) == 7
    assert seen == [["--layers", "4", "--help"], []]


def test_demo_missing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "strata_stream.demo", None)
    assert main(["demo", "--synthetic"]) == 2
    assert "demo is unavailable" in capsys.readouterr().err
