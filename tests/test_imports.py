"""No import cycle in src/: between modules, or between the packages under strata_stream.

Every import counts, wherever it is written (module level, inside a function, under
TYPE_CHECKING): an import moved into a function still ties the two modules together, it only
hides the cycle from the interpreter. `from a import b` depends on `a.b` when that is a module
(the compiled extensions count, by their stubs), else on `a`: importing a submodule runs its
package first in either spelling, so `from strata_stream import _core` ties a module to
strata_stream no more than `import strata_stream._core` does."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in [*SRC.rglob("*.py"), *SRC.rglob("_*.pyi")]:
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}

    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for m, deps in graph.items():
        packages.setdefault(package(m), set()).update(
            package(d) for d in deps if package(d) != package(m)
        )
    return graph, packages


def test_no_module_imports_itself_through_others() -> None:
    graph, _ = _graphs()
    assert len(graph) > 40 and "strata_stream.serve.worker" in graph
    assert "strata_stream.serve.lockstep" in graph["strata_stream.serve.worker"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_package_imports_itself_through_others() -> None:
    _, packages = _graphs()
    assert "strata_stream.mlx_lm" in packages["strata_stream.serve"]  # the server loads models
    assert _cycle(packages) is None, " -> ".join(_cycle(packages) or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
