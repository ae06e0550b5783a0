"""One settings surface: one name per setting from the environment to C++, the seed's names as
aliases of the one reader, one range check (the engine's validate()), and one place in each
language that reads the environment (docs/settings.md)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from strata_stream import StreamConfig
from strata_stream import _core as core
from strata_stream.config import SETTINGS, local_ranks_env
from strata_stream.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# The seed's behaviours: their STRATA_METAL_* names and the values that differ from the defaults.
SEED_ALIASES = [
    ("publish_prefetch", "STRATA_METAL_PUBLISH_PREFETCH", "0", False),
    ("two_layer_prompt", "STRATA_METAL_PROMPT_PRED2", "1", True),
    ("two_layer_max", "STRATA_METAL_PROMPT_PRED2_MAX", "100", 100),
    ("start_layers", "STRATA_METAL_PROMPT_START_LAYERS", "4", 4),
    ("prompt_buf_reuse", "STRATA_METAL_PROMPT_BUF_REUSE", "true", True),
    ("two_layer_decode", "STRATA_METAL_PREFETCH2", "on", True),
]


def test_every_field_is_one_setting_named_strata_and_its_field() -> None:
    fields = [f.name for f in dataclasses.fields(StreamConfig)]
    assert sorted(s.field for s in SETTINGS) == sorted(fields)
    for s in SETTINGS:
        assert s.env == "STRATA_" + s.field.upper()
        assert all(alias.startswith("STRATA_METAL_") for alias in s.aliases)
    assert len([s for s in SETTINGS if s.kind == "user"]) <= 10


def test_the_names_are_the_same_in_cpp() -> None:
    """Every StreamConfig field that the engine takes has that name in StreamOptions or
    WindowOptions: the names are the same end to end."""
    python_only = {"trace_path", "persist_profile"}  # the Python Window's own (record_routes)
    cpp = set(dir(core.StreamOptions())) | set(dir(core.WindowOptions()))
    missing = [s.field for s in SETTINGS if s.field not in python_only and s.field not in cpp]
    assert missing == []


@pytest.mark.parametrize(("field", "alias", "text", "value"), SEED_ALIASES)
def test_a_seed_behaviour_is_read_by_its_name_and_by_the_seeds(
    field: str, alias: str, text: str, value: object
) -> None:
    name = "STRATA_" + field.upper()
    by_name = StreamConfig.from_env(env={name: text})
    by_alias = StreamConfig.from_env(env={alias: text})
    assert getattr(by_name, field) == getattr(by_alias, field) == value
    assert getattr(StreamConfig.from_env(env={}), field) != value
    both = StreamConfig.from_env(env={name: text, alias: text})  # agreeing: no conflict
    assert getattr(both, field) == value


@pytest.mark.parametrize(("field", "alias", "text", "value"), SEED_ALIASES)
def test_a_conflicting_pair_is_an_error_naming_both(
    field: str, alias: str, text: str, value: object
) -> None:
    name = "STRATA_" + field.upper()
    default = getattr(StreamConfig(), field)
    other = ("1" if default else "0") if isinstance(default, bool) else str(default)
    with pytest.raises(ConfigError, match=rf"{name}=.* and {alias}=.* set {field} differently"):
        StreamConfig.from_env(env={name: text, alias: other})
    # An override wins over both, as over any environment.
    overridden = StreamConfig.from_env(env={name: text, alias: other}, **{field: value})
    assert getattr(overridden, field) == value


@pytest.mark.parametrize(
    ("field", "env_text", "bad", "message"),
    [
        ("io_threads", "1000", 1000, r"io_threads must be 0\.\.256"),
        ("part_bytes", "1000", 1000, "part_bytes must be a positive multiple of 16384"),
        ("io_spin_us", "200000", 200_000, r"io_spin_us must be 0\.\.100000"),
        ("max_rows", "0", 0, "max_rows must be positive"),
        ("start_layers", "-1", -1, r"start_layers must be 0\.\.4294967295, got -1"),
        ("moce", "sometimes", "sometimes", "moce must be off, scale or prune, got 'sometimes'"),
        ("eviction", "fifo", "fifo", "eviction must be decayed_lfu or lru, got 'fifo'"),
        ("moce_strength", "-0.5", -0.5, "moce_strength must be finite and >= 0, got -0.5"),
        ("device_timeout_s", "0", 0.0, "device_timeout_s must be positive and finite"),
    ],
)
def test_a_bad_value_gets_one_message_through_the_environment_and_the_constructor(
    field: str, env_text: str, bad: object, message: str
) -> None:
    """The engine's validate() is the one range check: the environment's text and a keyword
    argument meet it alike, and its message names the field."""
    with pytest.raises(ConfigError, match=message) as via_env:
        StreamConfig.from_env(env={"STRATA_" + field.upper(): env_text})
    with pytest.raises(ConfigError, match=message) as via_constructor:
        StreamConfig(**{field: bad})  # type: ignore[arg-type]
    assert str(via_env.value) == str(via_constructor.value)


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("verify_reads", 1, "verify_reads: expected a bool, got 1"),
        ("io_threads", 1.5, "io_threads: expected an int, got 1.5"),
        ("io_timeout_s", "60", "io_timeout_s: expected a number, got '60'"),
        ("moce_strength", "strong", "moce_strength: expected a number or None, got 'strong'"),
        ("direct_io", "yes", r"direct_io: expected a bool or None \(auto\), got 'yes'"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_where_it_is_converted(
    field: str, bad: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{message}$"):
        StreamConfig(**{field: bad})  # type: ignore[arg-type]


def test_numpy_numbers_convert_as_python_numbers() -> None:
    c = StreamConfig(moce="scale", moce_strength=np.float32(0.5), io_threads=np.int64(2))  # type: ignore[arg-type]
    assert c.window_options().moce_strength == 0.5
    assert c.stream_options(direct_io=False).io_threads == 2


def test_the_environment_text_that_cannot_be_read_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="STRATA_METAL_PROMPT_PRED2: expected 0/1/true/false"):
        StreamConfig.from_env(env={"STRATA_METAL_PROMPT_PRED2": "maybe"})
    with pytest.raises(ConfigError, match="STRATA_TWO_LAYER_MAX: expected an integer"):
        StreamConfig.from_env(env={"STRATA_TWO_LAYER_MAX": "lots"})


def test_a_bad_environment_value_is_one_line_from_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from strata_stream.cli import main

    pack = tmp_path / "tiny.strata"
    assert main(["pack", "--synthetic", "tiny", str(pack), "--quiet"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("STRATA_MAX_ROWS", "0")  # the demo takes the environment's settings
    assert main(["demo", "--synthetic", "--pack", str(pack)]) == 2
    err = capsys.readouterr().err.strip()
    assert "max_rows must be positive" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_local_ranks_and_the_cache_are_read_by_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert local_ranks_env({}) is None and local_ranks_env({"STRATA_LOCAL_RANKS": ""}) is None
    assert local_ranks_env({"STRATA_LOCAL_RANKS": "3"}) == 3
    with pytest.raises(ConfigError, match="STRATA_LOCAL_RANKS must be at least 1, got 0"):
        local_ranks_env({"STRATA_LOCAL_RANKS": "0"})
    from strata_stream.paths import cache_dir

    monkeypatch.setenv("STRATA_CACHE", "/somewhere/packs")
    assert cache_dir() == Path("/somewhere/packs")


def _calls(root: Path, pattern: str, suffixes: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix in suffixes and path.is_file():
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(pattern, line) and not line.lstrip().startswith(("//", "#")):
                    found.append(f"{path.relative_to(ROOT)}:{n}")
    return found


def test_one_place_in_each_language_reads_the_environment() -> None:
    cpp = _calls(ROOT / "csrc", r"\bgetenv\s*\(", (".h", ".cpp", ".cu", ".cuh", ".mm"))
    assert {c.split(":")[0] for c in cpp} == {"csrc/engine/common/env.h"}
    python = _calls(
        ROOT / "src" / "strata_stream",
        r"(environ(\.get)?\s*[\[(]\s*|getenv\s*\(\s*)[\"']STRATA_",
        (".py",),
    )
    assert {c.split(":")[0] for c in python} <= {"src/strata_stream/config.py"}


def test_docs_settings_names_every_setting_once() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    for s in SETTINGS:
        assert f"`{s.env}`" in doc, s.env
        for alias in s.aliases:
            assert f"`{alias}`" in doc, alias
    for extra in ("STRATA_CACHE", "STRATA_LOCAL_RANKS"):
        assert f"`{extra}`" in doc
