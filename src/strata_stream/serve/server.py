"""Running the app under uvicorn: in the foreground for the CLI, or on a background thread
(tests, benchmarks), always on a socket this module binds, so port 0 picks a free port
without a race."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from types import TracebackType
from typing import Any

from strata_stream.errors import ConfigError

log = logging.getLogger("strata_stream.serve")

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen(host: str, port: int) -> socket.socket:
    """Binds host:port before anything slow runs (the model load), so a port already in use
    fails at once with an error naming it."""
    try:
        return bind(host, port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM / Ctrl-C first tells the worker to drain (serve/worker.py `drain`): the
        streams in flight end with a finish_reason within the grace, so uvicorn's own
        graceful wait, a little longer, finds them closed instead of cancelling them."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            worker = getattr(getattr(app, "state", None), "worker", None)
            if worker is not None:
                worker.drain(drain_s)
            super().handle_exit(sig, frame)

    drain_s = float(getattr(getattr(app, "state", None), "drain_s", 5.0))
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(drain_s) + 5,
    )
    return DrainingServer(config)


def run_foreground(
    app: Any, host: str, port: int, *, log_level: str = "info", sock: socket.socket | None = None
) -> None:
    """Serves until interrupted (Ctrl-C / SIGTERM, handled by uvicorn), on `sock` when the
    caller bound it already (`listen`), else on host:port."""
    sock = sock if sock is not None else listen(host, port)
    bound = sock.getsockname()
    url_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    # The benchmark reads this line to find the port when started with --port 0.
    print(f"strata-stream serve: listening on http://{url_host}:{bound[1]}", flush=True)
    server = _uvicorn_server(app, log_level)
    with contextlib.closing(sock):
        server.run(sockets=[sock])


class BackgroundServer:
    """`with BackgroundServer(app) as s:` serves `app` on 127.0.0.1:<free port> from a thread;
    `s.url` is its base URL. Leaving the block shuts it down (bounded by `timeout_s`)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
        self._app = app
        self._host = host
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        self._sock = bind(self._host, 0)
        port = self._sock.getsockname()[1]
        self.url = f"http://{self._host}:{port}"
        self._server = _uvicorn_server(self._app, "warning")
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        waited = threading.Event()
        for _ in range(int(self._timeout_s / 0.02)):
            if self._server.started or not self._thread.is_alive():
                break
            waited.wait(0.02)
        if not self._server.started:
            self.__exit__(None, None, None)
            raise ConfigError(f"the server did not start within {self._timeout_s} s")
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self._timeout_s)
            if self._thread.is_alive():
                log.error("the background server did not stop within %s s", self._timeout_s)
        if self._sock is not None:
            self._sock.close()
