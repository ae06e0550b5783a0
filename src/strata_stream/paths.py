"""Where strata-stream keeps what it makes on a user's machine: packs and converted models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$STRATA_CACHE`` if set, else ``$XDG_CACHE_HOME/strata-stream``.

    Without either variable that is ``~/.cache/strata-stream``.
    """
    explicit = os.environ.get("STRATA_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata-stream"
