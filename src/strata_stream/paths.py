"""Where strata-stream keeps what it makes on a user's machine: packs and converted models."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from strata_stream.config import cache_dir_env


def cache_dir() -> Path:
    """``$STRATA_CACHE`` if set, else ``$XDG_CACHE_HOME/strata-stream``.

    Without either variable that is ``~/.cache/strata-stream``.
    """
    explicit = cache_dir_env()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata-stream"


def model_location(path_or_repo: str | os.PathLike[str]) -> str:
    """A local model directory (``~`` expanded) or a Hugging Face repo id, as given.

    What does not exist locally is taken for a repo id only if it can be one (``owner/name``):
    a path-like argument (a Path, one starting with ``/``, ``.`` or ``~``, with more than one
    separator, or whose parent directory exists here, as ``ck/`` of ``ck/chta``) that does not
    exist is a mistyped local path, refused here rather than looked up on the network. Raises
    ConfigError naming it.
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
        or (separators > 0 and local.parent.is_dir())
    )
    if pathlike:
        raise ConfigError(f"{text or repr(text)}: no such model directory")
    return text


# What `strata-stream convert REPO` and strata_stream.transformers fetch of a repo: mlx-lm's own
# download patterns (its DEFAULT_ALLOW_PATTERNS), so conversion and every loader find the same
# files in the snapshot (and so the same cached pack), and a repo's other copies of the weights
# (a consolidated.safetensors, .bin files) stay behind.
MODEL_FILES = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
               "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")  # fmt: skip


def model_dir(path_or_repo: str | os.PathLike[str], revision: str | None = None) -> Path:
    """The local directory of a model: `path_or_repo` where it is one, else the Hugging Face
    repo it names (model_location's rule), its MODEL_FILES fetched into the hub's cache: the
    snapshot mlx-lm's own download finds too.
    Raises ConfigError naming the cause (a mistyped local path, no huggingface_hub to fetch a
    repo with) and what checked_model_dir refuses."""
    from strata_stream.errors import ConfigError

    location = model_location(path_or_repo)
    local = Path(location)
    if not local.exists():
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ConfigError(
                f"{location}: not a local directory, and fetching it from the Hugging Face hub "
                "needs huggingface_hub (pip install huggingface_hub)"
            ) from None
        def fetch() -> str:
            return str(snapshot_download(location, revision=revision,
                                         allow_patterns=list(MODEL_FILES)))  # fmt: skip

        local = fetched(location, fetch)
    return checked_model_dir(local)


def fetched(location: str, fetch: Callable[[], str | os.PathLike[str]]) -> Path:
    """The directory `fetch()` returns for `location`; what fetching it from the hub raises (no
    network, no such repo, a malformed id: the hub's messages do not name the repo) as one
    OSError naming the model."""
    try:
        return Path(fetch())
    except (OSError, ValueError) as e:
        raise OSError(f"{location}: cannot fetch it from the Hugging Face hub: {e}") from e


def checked_model_dir(path: str | os.PathLike[str]) -> Path:
    """`path`, where it is a directory holding a config.json (every model a loader takes has
    one) and whole safetensors files; else ConfigError naming what it is instead, or
    CheckpointError naming the weights file that is damaged or unreadable."""
    from strata_stream.errors import CheckpointError, ConfigError

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: a file, not a model directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json (not a model directory?)")
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise CheckpointError(
                f"{weights}: {problem}; download or copy the model again (or convert it again "
                "from its source)"
            )
    return path


_MAX_HEADER = 100 << 20  # safetensors' own bound on a header


def safetensors_problem(path: Path) -> str:
    """Why `path` is not a whole safetensors file, in a phrase; "" when it is one. Reads its
    header only: the 8-byte length, the JSON, and whether the file holds every tensor's bytes
    (a cut-short download or copy does not)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"cut short: {size} bytes, less than a safetensors header"
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER:
                return "not a safetensors file (its first 8 bytes are no header length)"
            if n > size - 8:
                return f"cut short: its header alone needs {8 + n} bytes, the file has {size}"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except ValueError:  # JSON and UTF-8 errors
        return "not a safetensors file: its header is not JSON"
    if not isinstance(header, dict):
        return "not a safetensors file: its header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(v, int) for v in offsets)):  # fmt: skip
            return f"not a safetensors file: tensor {name!r} has no data_offsets"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return (
            f"cut short: it has {size} bytes, its tensors need {8 + n + end} (an incomplete "
            "download or copy?)"
        )
    return ""
