"""Where convert writes: the user's files, a shared or read-only cache, another model's pack.

- `-o` replaces a pack (of any model) and nothing else unless --force is given;
- a directory or a missing directory in `-o` fails before anything is converted, naming the
  path as typed;
- a conversion's temporaries are unique across processes, PID namespaces and hosts, and a live
  one is never taken for a leftover: a leftover is one whose lock nobody holds;
- an up-to-date pack is read without writing, so a read-only cache serves it;
- a pack of another model says which model it belongs to and never advises overwriting it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import strata_stream
from strata_stream.cli import main
from strata_stream.convert import convert
from strata_stream.convert.pack_cache import default_pack_path, ensure_pack, stale_reason
from strata_stream.errors import PackError
from strata_stream.pack import ExpertPack
from test_convert import _synthetic


def _error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("strata-stream: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _is_pack(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"STRATAPK"


def test_convert_replaces_a_pack_but_no_other_file_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = _synthetic(tmp_path / "m")
    notes = Path("notes.txt")
    notes.write_text("my notes\n")
    assert main(["convert", str(ckpt), "-o", "notes.txt", "--quiet"]) == 2
    _error(capsys, "notes.txt: the file exists and is not a strata-stream pack", "--force")
    assert notes.read_text() == "my notes\n"
    assert main(["convert", str(ckpt), "-o", "notes.txt", "--quiet", "--force"]) == 0
    assert _is_pack(notes)
    # A pack, of this model or another, is replaced as asked.
    other = convert(_synthetic(tmp_path / "o", seed=3), tmp_path / "other.strpk", progress=False)
    assert main(["convert", str(ckpt), "-o", str(other), "--quiet"]) == 0
    assert stale_reason(other, ckpt) is None
    assert main(["convert", str(ckpt), "--force"]) == 2
    _error(capsys, "--force applies to -o PACK only")


def test_a_bad_output_path_fails_before_converting_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from strata_stream import convert as convert_mod

    def never(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("converted before the output path was checked")

    monkeypatch.setattr(convert_mod, "write_pack", never)
    monkeypatch.chdir(tmp_path)
    ckpt = _synthetic(tmp_path / "m")
    Path("packs").mkdir()
    assert main(["convert", str(ckpt), "-o", "packs", "--quiet"]) == 2
    err = _error(capsys, "packs: is a directory")
    assert ".tmp" not in err
    assert main(["convert", str(ckpt), "-o", "nowhere/m.strpk", "--quiet"]) == 2
    err = _error(capsys, "nowhere/m.strpk: no such directory nowhere")
    assert ".tmp" not in err
    assert sorted(os.listdir(tmp_path)) == ["m", "packs"] and os.listdir("packs") == []


def test_group_size_without_quantize_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _synthetic(tmp_path / "m")
    out = tmp_path / "o.strpk"
    assert main(["convert", str(ckpt), "-o", str(out), "--group-size", "32", "--quiet"]) == 2
    _error(capsys, "--group-size applies to --quantize only")
    assert not out.exists()


def test_a_live_conversion_survives_another_namespaces_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two containers share a cache: while one converts, the other converts another model into
    the same cache, which clears what it takes for leftovers. The first one's writer has a pid
    the second cannot see, so nothing may be judged by pids: its staging directory is held by
    its lock (pack/staging.py), and its conversion must complete."""
    from strata_stream import convert as convert_mod
    from strata_stream.pack import writer

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    first, second = _synthetic(tmp_path / "a"), _synthetic(tmp_path / "b", seed=1)
    real = writer.write_pack
    cleaned: list[Path] = []
    started: list[bool] = []

    def write_pack(path: Path, *args: Any, **kwargs: Any) -> Path:
        experts = args[2]
        calls = 0

        def slow_experts(layer: int, e: int) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3 and not started:  # mid-write: the other container converts
                started.append(True)
                cleaned.append(ensure_pack(second, progress=False))
            return experts(layer, e)

        return real(path, args[0], args[1], slow_experts, *args[3:], **kwargs)

    monkeypatch.setattr(convert_mod, "write_pack", write_pack)
    made = ensure_pack(first, progress=False)
    assert cleaned and stale_reason(cleaned[0], second) is None
    assert made == default_pack_path(first) and stale_reason(made, first) is None
    assert [p.name for p in made.parent.iterdir() if p.name.endswith((".tmp", ".staging"))] == []


def _read_only(folder: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`argv` run with `folder` read-only: as root in a mount namespace of its own with a
    read-only bind mount over it (root writes through file modes), else with its modes."""
    here = str(Path(strata_stream.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    if os.geteuid() != 0:
        for d in (folder, *[p for p in folder.rglob("*") if p.is_dir()]):
            d.chmod(0o555)
        try:
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        finally:
            for d in (folder, *[p for p in folder.rglob("*") if p.is_dir()]):
                d.chmod(0o755)
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-m", "true"], capture_output=True).returncode:
        pytest.skip("root without unshare -m: cannot make a read-only folder")
    script = ('mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && touch "$0/.w" 2>/dev/null'
              ' && exit 99; exec "$@"')  # fmt: skip
    return subprocess.run([unshare, "-m", "sh", "-c", script, str(folder), *argv], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_read_only_cache_serves_an_up_to_date_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("STRATA_CACHE", str(cache))
    ckpt = _synthetic(tmp_path / "m")
    pack = ensure_pack(ckpt, progress=False)
    for leftover in pack.parent.glob(".*.lock"):
        leftover.unlink()  # as a cache copied in without them
    code = ("import sys; from pathlib import Path; from strata_stream.convert.pack_cache import "
            "ensure_pack; print(ensure_pack(Path(sys.argv[1]), progress=False))")  # fmt: skip
    got = _read_only(cache, [sys.executable, "-c", code, str(ckpt)])
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(pack)
    cli = [sys.executable, "-m", "strata_stream.cli", "convert", str(ckpt), "--quiet"]
    got = _read_only(cache, cli)
    assert got.returncode == 0, got.stderr
    assert str(pack) in got.stdout
    # A Window on it saves no profile there and says nothing (-W error: a warning would fail).
    code = ("import sys; from strata_stream import ExpertStream, StreamConfig, Window; "
            "s = ExpertStream(sys.argv[1], StreamConfig(persist_profile=True)); w = Window(s); "
            "w.save_profile(); w.close(); s.close()")  # fmt: skip
    got = _read_only(cache, [sys.executable, "-W", "error", "-c", code, str(pack)])
    assert got.returncode == 0 and not got.stderr, got.stderr
    # A conversion that is needed there says the cache is not writable, on one line.
    other = _synthetic(tmp_path / "other", seed=2)
    got = _read_only(cache, [*cli[:4], str(other), "--quiet"])
    assert got.returncode == 2 and "not writable" in got.stderr, got.stderr
    assert got.stderr.count("\n") == 1


def test_a_pack_of_another_model_says_whose_it_is(tmp_path: Path) -> None:
    mine, theirs = _synthetic(tmp_path / "mine"), _synthetic(tmp_path / "theirs", seed=5)
    pack = convert(theirs, tmp_path / "theirs.strpk", progress=False)
    with pytest.raises(PackError) as err:
        ensure_pack(mine, pack, progress=False)
    msg = str(err.value)
    assert "belongs to another model" in msg and str(theirs.resolve()) in msg
    assert f"-o {pack}" not in msg  # never advice that would overwrite the other model's pack
    with ExpertPack.open(pack) as p:
        assert stale_reason(pack, theirs) is None and p.metadata["source"] == str(theirs.resolve())
