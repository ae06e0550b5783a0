"""The dense weights in the arena budget, counted once: the resident ones through the container's
charge, and the part the front-end says is not resident yet (dense_pending) on top; without that
figure, the larger of the charge and the front-end's whole figure (the fake cgroup files of
test_container_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_stream import arena_budget
from strata_stream.errors import ConfigError
from test_container_memory import Fake, GiB, _QwenPack


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Fake:
    return Fake(monkeypatch, tmp_path)


def test_the_part_not_yet_resident_is_added_to_the_charge_once(fake: Fake) -> None:
    """A 2 GiB container charged 1.3 GiB (runtime and the resident dense weights), whose
    front-end holds 1.1 GiB of dense weights of which 4 MiB (an embedding's rows, left mapped)
    is not in the charge: in use is the charge plus those 4 MiB, not the larger of the two
    figures, which leaves out the runtime or counts the resident weights twice."""
    fake.proc.write_text("4:memory:/job\n0::/\n")
    charged, dense, pending = 1331 << 20, 1126 << 20, 4 << 20
    fake.v1("/job", 2 * GiB, usage=charged, inactive=0)
    pack = _QwenPack()
    b = arena_budget.budget(pack, None, dense_bytes=dense, dense_pending=pending)  # type: ignore[arg-type]
    assert (b.in_use, b.dense, b.dense_pending) == (charged + pending, dense, pending)
    left = 2 * GiB - charged - pending
    assert b.kv == int(arena_budget.KV_SHARE * left)
    assert b.margin == max(arena_budget.MARGIN_MIN, int(arena_budget.MARGIN_SHARE * left))
    assert b.arena == left - b.scratch - b.kv - b.margin > 0
    assert b.as_dict()["dense_pending_bytes"] == pending
    assert arena_budget.arena_size(pack, None, dense_bytes=dense, dense_pending=pending) == b.arena  # type: ignore[arg-type]
    # Without the figure: the larger of the charge and the whole dense weights, as before.
    old = arena_budget.budget(pack, None, dense_bytes=dense + GiB // 2)  # type: ignore[arg-type]
    assert old.in_use == dense + GiB // 2 and old.dense_pending is None


def test_a_negative_pending_figure_is_named(fake: Fake) -> None:
    fake.proc.write_text("4:memory:/job\n0::/\n")
    fake.v1("/job", 2 * GiB, usage=GiB, inactive=0)
    with pytest.raises(ConfigError, match="dense_pending must be >= 0, got -1"):
        arena_budget.budget(_QwenPack(), None, dense_bytes=GiB, dense_pending=-1)  # type: ignore[arg-type]


def test_an_explicit_arena_reports_the_dense_figures_as_given(fake: Fake) -> None:
    b = arena_budget.budget(_QwenPack(), GiB, dense_bytes=GiB, dense_pending=0)  # type: ignore[arg-type]
    assert (b.source, b.arena, b.dense, b.dense_pending) == ("requested", GiB, GiB, 0)
