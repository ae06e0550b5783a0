"""What the README tells a new user to run works: one install covers generate and serve, every
install line works from a clone (the package is not on PyPI), and the "Using it" snippet runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from strata_stream.cli import _SERVE_EXTRAS, _SERVE_MODULES

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _extra(name: str) -> set[str]:
    """The distributions an extra of pyproject.toml names, as importable module names."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = extras["optional-dependencies"][name]
    names = {re.split(r"[\[<>=;! ]", r, maxsplit=1)[0].strip().lower() for r in reqs}
    return {n.replace("-", "_") for n in names}


def test_the_first_install_covers_demo_generate_and_serve() -> None:
    first = next(line for line in README.splitlines() if line.startswith("pip install"))
    m = re.match(r'pip install "\.\[([a-z,]+)\]" && strata-stream demo', first)
    assert m, first
    installed = set().union(*(_extra(e) for e in m[1].split(",")))
    assert {"mlx", "mlx_lm"} <= installed  # demo and generate
    assert set(_SERVE_MODULES["mlx-lm"]) <= installed  # serve, no second install
    # The extra serve's own error names has everything serve imports, for either engine.
    for engine, modules in _SERVE_MODULES.items():
        assert set(modules) <= _extra(_SERVE_EXTRAS[engine]), engine


def test_no_install_line_assumes_the_package_is_published() -> None:
    assert not re.search(r"""pip install ["']?strata-stream\[""", README)
    assert "not on PyPI" in README


def test_the_using_it_snippet_runs(tmp_path: Path) -> None:
    section = README.split("## Using it", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    made = re.search(r"`(strata-stream pack [^`]+)`", code[1])
    assert made is not None, "the snippet says how its pack is made"
    argv = made[1].split()[1:]
    cli = [sys.executable, "-m", "strata_stream.cli", *argv, "--quiet"]
    subprocess.run(cli, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    got = subprocess.run([sys.executable, "-c", code[1]], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert "hit_rate" in got.stdout


def test_ci_still_finds_the_test_command() -> None:
    """.ci/run takes the README's `pip install ".[test]"` line as the test command."""
    lines = [line for line in README.splitlines() if re.match(r'^pip install "\.\[test\]"', line)]
    assert lines and "python -m pytest" in lines[0]
    if not (ROOT / ".ci" / "run").exists():
        pytest.skip("no .ci/run here")
    assert 'pip install "\\.\\[test\\]"' in (ROOT / ".ci" / "run").read_text()
