"""StreamConfig: defaults, environment flags with the seed's names, and every ConfigError."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strata_stream import StreamConfig
from strata_stream.config import ENV_FLAGS, parse_size
from strata_stream.errors import ConfigError


def test_defaults_are_the_seed_defaults() -> None:
    c = StreamConfig.from_env(env={})
    assert c.publish_prefetch is True
    assert c.two_layer_prompt is False
    assert c.two_layer_max == 64
    assert c.start_layers == 1
    assert c.prompt_buf_reuse is False
    assert c.two_layer_decode is False


def test_environment_flags_are_read_by_their_names() -> None:
    env = {
        "STRATA_METAL_PUBLISH_PREFETCH": "0",
        "STRATA_METAL_PROMPT_PRED2": "1",
        "STRATA_METAL_PROMPT_PRED2_MAX": "100",
        "STRATA_METAL_PROMPT_START_LAYERS": "4",
        "STRATA_METAL_PROMPT_BUF_REUSE": "true",
        "STRATA_METAL_PREFETCH2": "on",
        "STRATA_ARENA_BYTES": "2GiB",
        "STRATA_IO_THREADS": "12",  # above any default (4-8)
        "STRATA_IO_SPIN_US": "75",
        "STRATA_PART_BYTES": "512k",
        "STRATA_DIRECT_IO": "no",
        "STRATA_EVICTION": "lru",
    }
    c = StreamConfig.from_env(env=env)
    assert (c.publish_prefetch, c.two_layer_prompt, c.two_layer_max) == (False, True, 100)
    assert (c.start_layers, c.prompt_buf_reuse, c.two_layer_decode) == (4, True, True)
    assert c.arena_bytes == 2 << 30 and c.io_threads == 12 and c.part_bytes == 512 << 10
    assert c.direct_io is False and c.io_spin_us == 75
    assert c.eviction == "lru" and StreamConfig().eviction == "decayed_lfu"


def test_direct_io_auto_reads_a_pack_directly_only_when_it_outgrows_a_quarter_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from strata_stream import config

    assert StreamConfig().direct_io is None  # auto by default
    assert StreamConfig.from_env(env={"STRATA_DIRECT_IO": "auto"}).direct_io is None
    assert StreamConfig.from_env(env={"STRATA_DIRECT_IO": "1"}).direct_io is True
    monkeypatch.setattr(config, "memory_bytes", lambda: 16 << 30)
    auto = StreamConfig()
    assert auto.direct_io_for(4 << 30) is False  # a quarter of 16 GiB: the page cache holds it
    assert auto.direct_io_for((4 << 30) + 1) is True
    assert StreamConfig(direct_io=True).direct_io_for(1) is True  # set: never overridden
    assert StreamConfig(direct_io=False).direct_io_for(1 << 50) is False
    monkeypatch.setattr(config, "memory_bytes", lambda: None)
    assert auto.direct_io_for(1) is True  # memory unknown: the engine's design default
    monkeypatch.undo()
    memory = config.memory_bytes()
    assert memory is not None and memory > 1 << 28


def test_memory_bytes_takes_a_smaller_container_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from strata_stream import config, container_memory

    (tmp_path / "proc").write_text("4:memory:/\n0::/\n")
    monkeypatch.setattr(container_memory, "PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(container_memory, "CGROUP_ROOT", str(tmp_path))
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory" / "memory.limit_in_bytes"
    machine = config.memory_bytes()  # neither file exists: the machine's memory
    assert machine is not None
    v1.parent.mkdir()
    v1.write_text(f"{1 << 30}\n")  # v1 alone: its limit
    assert config.memory_bytes() == min(machine, 1 << 30)
    v1.write_text(f"{(1 << 63) - 4096}\n")  # v1's "no limit"
    assert config.memory_bytes() == machine
    v2.write_text("max\n")  # v2 first, unlimited: the machine's memory, v1 not read
    v1.write_text(f"{1 << 30}\n")
    assert config.memory_bytes() == machine
    v2.write_text(f"{2 << 30}\n")
    assert config.memory_bytes() == min(machine, 2 << 30)
    v2.write_text(f"{machine * 4}\n")  # a limit above the machine's memory does not raise it
    assert config.memory_bytes() == machine


def test_default_io_threads_follow_the_cores_from_4_to_8() -> None:
    from strata_stream import config

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert StreamConfig().io_threads == config.DEFAULT_IO_THREADS == min(8, max(4, cores or 4))
    assert StreamConfig().part_bytes == 256 << 10
    assert StreamConfig().io_spin_us == 0  # spinning IO holds cores: opt-in


def test_moce_flags() -> None:
    c = StreamConfig.from_env(env={})
    assert (c.moce, c.moce_strength, c.moce_keep_top) == ("off", None, 2)
    env = {"STRATA_MOCE": "Prune", "STRATA_MOCE_STRENGTH": "0.1", "STRATA_MOCE_KEEP_TOP": "3"}
    c = StreamConfig.from_env(env=env)
    assert (c.moce, c.moce_strength_value, c.moce_keep_top) == ("prune", 0.1, 3)
    # Unset strength means the mode's default, resolved late so replace(moce=...) stays right.
    assert StreamConfig(moce="scale").moce_strength_value == 2.0
    assert StreamConfig(moce="scale").replace(moce="prune").moce_strength_value == 0.05


def test_overrides_win_over_the_environment() -> None:
    c = StreamConfig.from_env(env={"STRATA_IO_THREADS": "8"}, io_threads=2)
    assert c.io_threads == 2


@pytest.mark.parametrize(("value", "clamped"), [("-5", 0), ("600", 512), ("512", 512)])
def test_pred2_max_is_clamped_as_the_seed_does(value: str, clamped: int) -> None:
    c = StreamConfig.from_env(env={"STRATA_METAL_PROMPT_PRED2_MAX": value})
    assert c.two_layer_max == clamped


@pytest.mark.parametrize(
    ("var", "value", "match"),
    [
        ("STRATA_METAL_PROMPT_PRED2", "maybe", "STRATA_METAL_PROMPT_PRED2"),
        ("STRATA_METAL_PUBLISH_PREFETCH", "2", "STRATA_METAL_PUBLISH_PREFETCH"),
        ("STRATA_METAL_PROMPT_PRED2_MAX", "lots", "STRATA_METAL_PROMPT_PRED2_MAX"),
        ("STRATA_METAL_PROMPT_START_LAYERS", "-1", "start_layers"),
        ("STRATA_ARENA_BYTES", "big", "STRATA_ARENA_BYTES"),
        ("STRATA_ARENA_BYTES", "0", "arena_bytes"),
        ("STRATA_PART_BYTES", "1000", "part_bytes"),
        ("STRATA_IO_THREADS", "x", "STRATA_IO_THREADS"),
        ("STRATA_IO_THREADS", "1000", "io_threads"),
        ("STRATA_IO_SPIN_US", "-1", "io_spin_us"),
        ("STRATA_IO_SPIN_US", "1e9", "STRATA_IO_SPIN_US"),
        ("STRATA_IO_SPIN_US", "200000", "io_spin_us"),
        ("STRATA_EVICTION", "fifo", "eviction"),
        ("STRATA_DIRECT_IO", "sometimes", "STRATA_DIRECT_IO"),
        ("STRATA_MOCE", "sometimes", "moce must be off, scale or prune"),
        ("STRATA_MOCE_STRENGTH", "strong", "STRATA_MOCE_STRENGTH"),
        ("STRATA_MOCE_STRENGTH", "-0.5", "moce_strength"),
        ("STRATA_MOCE_KEEP_TOP", "two", "STRATA_MOCE_KEEP_TOP"),
        ("STRATA_MOCE_KEEP_TOP", "-1", "moce_keep_top"),
    ],
)
def test_bad_environment_values_name_the_variable_or_field(
    var: str, value: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        StreamConfig.from_env(env={var: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("arena_bytes", -1),
        ("io_threads", 1.5),
        ("direct_io", "yes"),
        ("part_bytes", 0),
        ("io_timeout_s", 0.0),
        ("publish_prefetch", 1),
        ("moce", "on"),
        ("moce_strength", -1.0),
        ("moce_strength", float("nan")),
        ("moce_keep_top", -1),
        ("moce_keep_top", 1.0),
    ],
)
def test_bad_field_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        StreamConfig(**{field: value})  # type: ignore[arg-type]


def test_unknown_override_is_named() -> None:
    with pytest.raises(ConfigError, match="no field arena_size"):
        StreamConfig.from_env(env={}, arena_size=1)


def test_every_flag_has_a_field() -> None:
    names = set(StreamConfig.__dataclass_fields__)
    assert set(ENV_FLAGS) <= names


def test_parse_size() -> None:
    assert parse_size("4096", "x") == 4096
    assert parse_size("1.5 GiB", "x") == 3 << 29
    with pytest.raises(ConfigError, match="what"):
        parse_size("-3", "what")
