"""Routing trace files: which experts each token chose, layer by layer.

Formats read:
- ``route_trace v1`` (the format of ``tests/data/qwen3-30b-a3b.route.csv``): ``#`` comment lines
  (the model line gives ``n_layer``, ``n_expert``, ``n_expert_used``), then CSV columns
  ``turn,phase,step,layer,slot,expert,...``, one row per routed expert. Accesses are ordered
  token by token (turn, phase, step), each token layer by layer, each layer slot by slot: the
  order that reproduces the trace's published LRU figure (its prompt rows are stored layer-major).
- ``strata_trace v1`` (ours, written by ``Window`` with ``StreamConfig.trace_path``): a first
  line ``# strata_trace v1 n_layers=L n_experts=E top_k=K``, then CSV columns
  ``token,layer,expert`` in access order.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from strata_stream.errors import PackError


@dataclass(frozen=True)
class Trace:
    n_layers: int
    n_experts: int
    top_k: int
    # One entry per (token, layer) in access order: (layer, experts in slot order).
    steps: tuple[tuple[int, tuple[int, ...]], ...]

    def accesses(self) -> list[int]:
        """Expert keys (layer * n_experts + expert) in access order."""
        return [layer * self.n_experts + e for layer, experts in self.steps for e in experts]


def strata_trace_header(n_layers: int, n_experts: int, top_k: int) -> str:
    """The first two lines of a strata_trace v1 file."""
    return (
        f"# strata_trace v1 n_layers={n_layers} n_experts={n_experts} top_k={top_k}\n"
        "token,layer,expert\n"
    )


def strata_trace_rows(rows: Iterable[Sequence[int]]) -> str:
    """(token, layer, expert) triples as strata_trace v1 lines."""
    return "".join(f"{t},{layer},{e}\n" for t, layer, e in rows)


def write_strata_trace(
    path: str | Path, n_layers: int, n_experts: int, top_k: int, rows: Iterable[Sequence[int]]
) -> Path:
    """A whole strata_trace v1 file from (token, layer, expert) triples in access order."""
    path = Path(path)
    path.write_text(strata_trace_header(n_layers, n_experts, top_k) + strata_trace_rows(rows))
    return path


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise PackError(f"trace {path}: cannot read: {err.strerror}") from None
    if lines and lines[0].startswith("# strata_trace v1"):
        return _read_strata_trace(path, lines)
    if lines and lines[0].startswith("# route_trace v1"):
        return _read_route_trace(path, lines)
    raise PackError(
        f"trace {path}: unknown format (expected '# route_trace v1' or "
        f"'# strata_trace v1' on the first line)"
    )


def _header_int(path: Path, text: str, name: str) -> int:
    match = re.search(rf"\b{name}=(\d+)", text)
    if not match:
        raise PackError(f"trace {path}: header has no {name}=")
    return int(match.group(1))


def _read_route_trace(path: Path, lines: list[str]) -> Trace:
    header = " ".join(line for line in lines if line.startswith("#"))
    n_layers = _header_int(path, header, "n_layer")
    n_experts = _header_int(path, header, "n_expert")
    top_k = _header_int(path, header, "n_expert_used")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line or line.startswith("#") or line.startswith("turn"):
            continue
        fields = line.split(",")
        try:
            turn, phase, step, layer, slot, expert = (int(f) for f in fields[:6])
        except ValueError:
            raise PackError(f"trace {path}:{number}: expected integers, got {line!r}") from None
        if not (0 <= layer < n_layers and 0 <= expert < n_experts):
            raise PackError(f"trace {path}:{number}: layer {layer} or expert {expert} out of range")
        rows.append((turn, phase, step, layer, slot, expert))
    rows.sort()
    return Trace(n_layers, n_experts, top_k, _group(rows, 4, 3, 5))


def _read_strata_trace(path: Path, lines: list[str]) -> Trace:
    n_layers = _header_int(path, lines[0], "n_layers")
    n_experts = _header_int(path, lines[0], "n_experts")
    top_k = _header_int(path, lines[0], "top_k")
    rows = []
    for number, line in enumerate(lines[1:], 2):
        if not line or line.startswith("#") or line.startswith("token"):
            continue
        try:
            token, layer, expert = (int(f) for f in line.split(",")[:3])
        except ValueError:
            raise PackError(f"trace {path}:{number}: expected token,layer,expert") from None
        if not (0 <= layer < n_layers and 0 <= expert < n_experts):
            raise PackError(f"trace {path}:{number}: layer {layer} or expert {expert} out of range")
        rows.append((token, layer, expert))
    # A Window records a prompt chunk layer by layer (every token's layer 0, then layer 1, ...):
    # in access order a token is one pass over the layers, as a replay runs it. Stable, so each
    # step keeps its experts in the order they were chosen.
    rows.sort(key=lambda r: (r[0], r[1]))
    return Trace(n_layers, n_experts, top_k, _group(rows, 2, 1, 2))


def _group(
    rows: Sequence[tuple[int, ...]], width: int, layer_at: int, expert_at: int
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Rows sorted in access order -> one (layer, experts) step per distinct rows[:width]."""
    steps: list[tuple[int, tuple[int, ...]]] = []
    for _, group in itertools.groupby(rows, key=lambda r: r[:width]):
        members = list(group)
        experts = tuple(dict.fromkeys(r[expert_at] for r in members))  # unique, in slot order
        steps.append((members[0][layer_at], experts))
    return tuple(steps)
