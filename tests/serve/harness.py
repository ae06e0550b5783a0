"""What the serve tests stand up: a server over a model, the tiny model streamed from a pack over
a quarter arena, the tiny transformers checkpoint streamed the same way, and the clients of a
server whose model can be made to write a tool call. helpers.py holds what talks to a server
once it runs; conftest.py the fixtures built from these.

Only scaffolding lives here: what a test checks stays in the test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve.helpers import MODEL_ID, TIMEOUT_S, anthropic_client_for, client_for
from strata_stream.config import StreamConfig
from strata_stream.pack.reader import ExpertPack
from strata_stream.serve import BackgroundServer, ServeConfig, create_app
from strata_stream.serve.prompt_cache import PromptCacheConfig

if TYPE_CHECKING:
    from test_transformers_families import Family

# The worker's own prompt-cache default: `serving` leaves it alone unless given another.
WORKER_DEFAULT: Any = object()
# What the streamed loads in these tests read through: no O_DIRECT (a test's temporary
# directory may not take it) and no profile file beside the pack (the session's pack is shared).
STREAM_CONFIG = StreamConfig(direct_io=False, persist_profile=False)


@dataclass
class Running:
    """A server `serving` started: its base URL, its app and the BackgroundServer itself."""

    url: str
    app: Any
    server: BackgroundServer


@contextmanager
def serving(
    model: Any,
    tokenizer: Any,
    config: ServeConfig | None = None,
    *,
    prompt_cache: PromptCacheConfig | None = WORKER_DEFAULT,
    close_engine: bool = False,
    **app_kw: Any,
) -> Iterator[Running]:
    """A server over `model` on a free loopback port for the block, shut down when the block
    ends. `config` defaults to ServeConfig(model_id=MODEL_ID); `app_kw` goes to
    create_app (stats=, engine=). `prompt_cache`: the worker's prompt cache (None: none), set
    before it starts, as the CLI does. `close_engine`: the model's streamed experts engine is
    closed when the block ends, whatever happened in it (the model was loaded for it)."""
    try:
        app = create_app(model, tokenizer, config or ServeConfig(model_id=MODEL_ID), **app_kw)
        if prompt_cache is not WORKER_DEFAULT:
            app.state.worker.configure_prompt_cache(prompt_cache)
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as server:
            yield Running(server.url, app, server)
    finally:
        if close_engine:
            model.strata_engine.close()


# ---- the tiny mlx-lm model, its experts streamed ------------------------------------------------
def quarter_arena(pack: Path) -> int:
    """Arena bytes for a quarter of the pack's experts (at least two tokens' top-k): the
    experts must stream, not all stay resident."""
    with ExpertPack.open(pack) as p:
        records, stride, top_k = p.geometry.n_records, p.record_stride, p.geometry.top_k
    return max(records * stride // 4, 2 * top_k * stride)


def load_streamed(checkpoint: Path, pack: Path, **kw: Any) -> tuple[Any, Any]:
    """strata_stream.mlx_lm.load of `checkpoint` from `pack` (converted there first if it is
    not yet), through STREAM_CONFIG, quietly; `kw` (arena_bytes=, experts=) goes to load. The
    caller closes `model.strata_engine`."""
    from strata_stream.mlx_lm import load

    model, tokenizer = load(str(checkpoint), pack_path=pack, config=STREAM_CONFIG,
                            progress=False, **kw)  # fmt: skip
    return model, tokenizer


# ---- the tiny transformers checkpoint ----------------------------------------------------------
def family(root: Path) -> Family:
    """The tiny float32 qwen3_moe checkpoint of tests/test_transformers_families.py under
    `root`: its pack and its plain-transformers oracle (`.ref`)."""
    tests = str(Path(__file__).resolve().parent.parent)  # tests/: the families module
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from test_transformers_families import Family

    return Family("qwen3_moe", root, "float32")


def hf_tokenizer(fam: Family) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(fam.path)


def quarter_streamed(fam: Family) -> Any:
    """The checkpoint on the transformers engine, its experts streamed through a quarter of
    them. The caller closes `model.strata_engine` (serving(close_engine=True) does)."""
    return fam.load(slots=fam.n_records // 4)


# ---- the clients of a server whose model may write a tool call ---------------------------------
class Clients:
    """A running server's URL and its `openai` and `anthropic` clients (no retries: a 503 or
    529 reaches the test), and the switch that forces the tool call (tool_model.py), if any."""

    def __init__(self, url: str, forced: Any = None) -> None:
        self.url = url
        self.forced = forced
        self.openai = client_for(url)
        self.anthropic = anthropic_client_for(url)
