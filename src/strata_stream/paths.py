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


def model_location(path_or_repo: str | os.PathLike[str]) -> str:
    """A local model directory (``~`` expanded) or a Hugging Face repo id, as given.

    What does not exist locally is taken for a repo id only if it can be one (``owner/name``):
    a path-like argument (a Path, one starting with ``/``, ``.`` or ``~``, or with more than one
    separator) that does not exist is a mistyped local path, refused here rather than looked
    up on the network. Raises ConfigError naming it.
    """
    from strata_stream.errors import ConfigError

    text = os.fspath(path_or_repo)
    if not text:
        raise ConfigError("the model is an empty string: name a model directory or repo")
    local = Path(text).expanduser()
    if local.exists():
        return str(local)
    separators = text.count("/") + (text.count(os.sep) if os.sep != "/" else 0)
    pathlike = (
        not isinstance(path_or_repo, str)
        or text.startswith(("/", ".", "~"))
        or separators > 1
        or text.endswith("/")
    )
    if pathlike:
        raise ConfigError(f"{text or repr(text)}: no such model directory")
    return text
