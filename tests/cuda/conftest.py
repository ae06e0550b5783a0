"""CUDA tests (marker `cuda`): run where a CUDA GPU and strata_stream._cuda exist, or when asked
for with ``-m cuda``; elsewhere they are deselected (not skipped), so the README's test command
passes unchanged on machines without a GPU and reports no false skips."""

from __future__ import annotations

import importlib

import pytest


def cuda_unavailable() -> str:
    """Why backend="cuda" cannot run here; "" when it can."""
    try:
        mod = importlib.import_module("strata_stream._cuda")
    except ImportError:
        return "this build has no strata_stream._cuda"
    return str(mod.unavailable())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "cuda" in (config.option.markexpr or "") or cuda_unavailable() == "":
        return
    keep = [i for i in items if i.get_closest_marker("cuda") is None]
    dropped = [i for i in items if i.get_closest_marker("cuda") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
