"""The `strata-stream` CLI, driven through main(argv) return codes."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

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


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("strata-stream: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_generate_mistakes_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    ok = ["generate", str(model), "--prompt", "hello"]
    for argv, needle in (
        (["generate", "./modle", "--prompt", "hi"], "./modle: no such model directory"),
        (["generate", str(tmp_path / "typo"), "--prompt", "hi"], "no such model directory"),
        (["generate", "~/nope-strata", "--prompt", "hi"], "no such model directory"),
        (["generate", str(model), "--prompt", ""], "--prompt is empty"),
        (["generate", str(model), "--prompt", "  "], "--prompt is empty"),
        ([*ok, "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        ([*ok, "--max-tokens", "-1"], "--max-tokens must be at least 1, got -1"),
        ([*ok, "--arena-gb", "nan"], "--arena-gb must be a number of GiB > 0, got nan"),
        ([*ok, "--arena-gb", "inf"], "--arena-gb must be a number of GiB > 0, got inf"),
        ([*ok, "--arena-gb", "0"], "--arena-gb must be"),
        (ok, "model: no config.json (not a model directory?)"),
    ):
        assert main(argv) == 2, argv
        _one_line_error(capsys, needle)


def test_a_repo_id_is_not_taken_for_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from strata_stream.errors import ConfigError
    from strata_stream.paths import model_location

    here = tmp_path / "a" / "b"  # ./x and ../x resolve inside tmp_path, whatever the cwd holds
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    assert model_location("mlx-community/Qwen3-30B-A3B-4bit") == "mlx-community/Qwen3-30B-A3B-4bit"
    assert model_location(tmp_path) == str(tmp_path)
    for bad in ("./x", "../x", "/no/such", "a/b/c", "owner/name/", tmp_path / "x"):
        with pytest.raises(ConfigError, match="no such model directory"):
            model_location(bad)


def test_a_path_under_a_local_directory_is_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ck/chta` with a local `ck/` is a mistyped local path, never a repo id to fetch."""
    from strata_stream.errors import ConfigError
    from strata_stream.paths import model_location

    (tmp_path / "ck").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="ck/chta: no such model directory"):
        model_location("ck/chta")
    assert main(["convert", "ck/chta"]) == 2
    _one_line_error(capsys, "ck/chta: no such model directory")
    # A name with no local parent is still a repo id.
    assert model_location("nobody-here/model") == "nobody-here/model"


def test_serve_without_its_extra_names_the_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def without_fastapi(name: str, *args: Any) -> Any:
        return None if name == "fastapi" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_fastapi)
    assert main(["serve", str(tmp_path)]) == 2
    _one_line_error(capsys, "serve needs fastapi", 'pip install ".[mlx]" in a clone')
    monkeypatch.undo()
    pytest.importorskip("fastapi")
    for argv, needle in (
        (["serve", str(tmp_path), "--arena-gb", "inf"], "--arena-gb must be"),
        (["serve", str(tmp_path / "typo")], "no such model directory"),
        (["serve", str(tmp_path), "--pack", "p", "--tensor"], "--pack names one pack"),
        (["serve", str(tmp_path), "--max-batch", "0"], "--max-batch must be at least 1, got 0"),
        (["serve", str(tmp_path), "--max-queue", "0"], "--max-queue must be at least 1, got 0"),
        (["serve", str(tmp_path), "--prefill-chunk", "-1"], "--prefill-chunk must be at least 1"),
    ):
        assert main(argv) == 2, argv
        _one_line_error(capsys, needle)


def test_convert_without_out_writes_the_pack_load_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from strata_stream.convert.pack_cache import default_pack_path, ensure_pack
    from test_convert import _synthetic

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    ckpt = _synthetic(tmp_path / "m")
    assert main(["convert", str(ckpt), "--quiet"]) == 0
    pack = default_pack_path(ckpt)
    assert f"{pack} (" in capsys.readouterr().out and pack.exists()
    made = pack.stat().st_mtime_ns
    assert ensure_pack(ckpt, progress=False) == pack and pack.stat().st_mtime_ns == made
    assert main(["convert", str(ckpt), "-o", str(tmp_path / "o.strpk"), "--quiet"]) == 0
    assert f"use it with --pack {tmp_path / 'o.strpk'}" in capsys.readouterr().out


def test_convert_takes_the_model_generate_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped path or a directory that holds no model is one line naming it, before anything
    is converted; a repo id is fetched as load() fetches it (the hub here a local snapshot), and
    its pack lands in the cache entry load() finds for that snapshot."""
    import huggingface_hub

    from strata_stream.convert.pack_cache import default_pack_path
    from test_convert import _synthetic

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, needle in (
        (["convert", str(tmp_path / "typo")], "typo: no such model directory"),
        (["convert", "./modle", "-o", "o.pack"], "./modle: no such model directory"),
        (["convert", str(empty)], "empty: no config.json (not a model directory?)"),
    ):
        assert main(argv) == 2, argv
        _one_line_error(capsys, needle)
    snapshot = _synthetic(tmp_path / "hub" / "snapshot")
    fetched: list[tuple[str, list[str] | None]] = []

    def snapshot_download(repo_id: str, revision: str | None = None,
                          allow_patterns: list[str] | None = None) -> str:  # fmt: skip
        fetched.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert main(["convert", "owner/model", "--quiet"]) == 0
    assert [repo for repo, _ in fetched] == ["owner/model"]
    assert fetched[0][1] is not None and "model*.safetensors" in fetched[0][1]
    # The same files mlx-lm's own download takes, so both find one snapshot and one pack.
    mlx_utils = pytest.importorskip("mlx_lm.utils")
    assert fetched[0][1] == list(mlx_utils.DEFAULT_ALLOW_PATTERNS)
    pack = default_pack_path(snapshot)
    assert f"{pack} (" in capsys.readouterr().out and pack.exists()


def test_a_failed_fetch_is_one_line_naming_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's errors run over several lines; the command's is one, and names the model, for
    convert (strata-stream's own fetch) and generate (mlx-lm's) alike."""
    import huggingface_hub

    def offline(repo_id: str, **kwargs: Any) -> str:
        raise OSError("Got: ConnectError\nPlease check your internet connection and try again.")

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    needles = ("owner/model: cannot fetch it from the Hugging Face hub: Got: ConnectError Please "
               "check your internet connection")  # fmt: skip
    assert main(["convert", "owner/model"]) == 2
    _one_line_error(capsys, needles)
    mlx_utils = pytest.importorskip("mlx_lm.utils")
    monkeypatch.setattr(mlx_utils, "snapshot_download", offline)
    assert main(["generate", "owner/model", "--prompt", "hi", "--engine", "mlx-lm"]) == 2
    _one_line_error(capsys, needles)


def test_generate_refuses_more_tokens_than_the_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlx_lm")
    from mlx_models import make_checkpoint

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    model = make_checkpoint("qwen3_moe", tmp_path / "model")  # max_position_embeddings 512
    # `convert` without -o writes where generate looks: generate converts nothing (stderr).
    assert main(["convert", str(model), "--quiet"]) == 0
    capsys.readouterr()
    argv = ["generate", str(model), "--prompt", "w1 w2 w3", "--arena-gb", "0.01"]
    assert main([*argv, "--max-tokens", "600"]) == 2
    _one_line_error(capsys, "--max-tokens 600 is beyond the model's maximum context length of "
                    "512 tokens", "at most 509 can be generated")  # fmt: skip
    assert main([*argv, "--max-tokens", "2"]) == 0
    assert "decode  1 tokens" in capsys.readouterr().out


def test_byte_counts_are_in_a_unit_that_fits() -> None:
    from strata_stream.units import human_bytes

    assert human_bytes(12) == "12 bytes"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(6 * 16384) == "96.0 KiB"
    assert human_bytes(300 << 20) == "300 MiB"
    assert human_bytes(4.08e9) == "3.80 GiB"


def test_inspect_and_verify_without_the_extension_are_one_line_naming_it(tmp_path: Path) -> None:
    """The engine's code parses pack headers (the one parser) and computes record checksums
    (CRC32C): where the extension failed to build, inspect and verify each fail with one line
    naming it, never a traceback."""
    import subprocess

    out = tmp_path / "t.strpk"
    assert main(["pack", "--synthetic", "tiny", str(out), "--quiet"]) == 0
    code = (
        "import sys; sys.modules['strata_stream._core'] = None\n"
        "from strata_stream.cli import main\n"
        f"sys.exit(main([sys.argv[1], {str(out)!r}, *sys.argv[2:]]))"
    )
    for command in ("inspect", "verify"):  # verify: --quiet, no progress bar
        quiet = ["--quiet"] if command == "verify" else []
        r = subprocess.run([sys.executable, "-c", code, command, *quiet], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert r.stderr.startswith("strata-stream: error: strata_stream._core is not built")
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_demo_keep_leaves_a_model_generate_runs_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`demo --keep DIR` keeps its checkpoint (and converts its pack into the cache): a local
    model a new user can run every command on without a download."""
    pytest.importorskip("mlx_lm")
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    keep = tmp_path / "models"
    assert main(["demo", "--keep", str(keep), "--tokens", "2", "--experts", "cpu"]) == 0
    kept = keep / "qwen3_moe"
    assert f"kept {kept}" in capsys.readouterr().out
    assert (kept / "config.json").is_file()
    assert main(["generate", str(kept), "--prompt", "w0 w7", "--max-tokens", "2"]) == 0
    got = capsys.readouterr()
    assert "decode" in got.out and "converting" not in got.err  # the pack the demo made
    assert main(["demo", "--keep", str(keep), "--tokens", "2"]) == 2  # nothing is replaced
    _one_line_error(capsys, f"{kept} exists already")


def test_serve_waits_for_as_many_requests_as_the_server_defaults_to() -> None:
    # The CLI cannot import ServeConfig (its package needs FastAPI, generate does not), so
    # --max-queue repeats its default; lm-eval's 16 concurrent requests need most of it.
    pytest.importorskip("fastapi")
    from strata_stream.cli import _build_parser
    from strata_stream.serve import ServeConfig

    args = _build_parser().parse_args(["serve", "some/model"])
    assert args.max_queue == ServeConfig.max_queue
