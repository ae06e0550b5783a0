"""Window: MoE layers routed and computed through the per-layer CPU/GPU handshake.

`Window(stream, backend="cpu").moe(layer, x)` routes x through the layer's router, streams the
chosen experts in (predicting the next layer's as it goes), runs the expert passes on the
backend and returns the layer's MoE output. The per-layer work runs in C++ with the GIL
released; the engine checks expert ids and options against the pack (once, in C++) and keeps
turn order; this wrapper adds the Python-side resources (trace file, saved profile).

Turns: layer calls go 0, 1, ..., L-1 (then 0 again for the next token). `with window.turn():`
marks a turn explicitly (protections span it); a call outside one opens a turn that closes when
the last layer returns.

Threads: every method may be called from any thread. A turn belongs to the thread that opened
it; another thread's moe(), turn() or end of it raises TurnError. close() from another thread
waits for the layer in flight, then fails the turn (the owner's next call raises
StreamClosedError) and frees the device thread, its pool and the scratch at once. Several
Windows may share one ExpertStream (one per sequence), each on its own thread: each owns its
protections in the shared arena and stays bitwise exact; when their protected experts together
fill the arena, a call waits (up to io_timeout_s) for another Window to move on, then raises
ArenaFullError.

NaN policy: inputs are not scanned (that would cost a pass over every activation); NaN or inf in
x propagates to the output rows it touches, as in the unstreamed model.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from strata_stream.errors import ConfigError, StreamClosedError
from strata_stream.pack.staging import unique_temporary
from strata_stream.stream import ExpertStream, ProcessBound
from strata_stream.trace.format import strata_trace_header, strata_trace_rows

if TYPE_CHECKING:
    from strata_stream import _core

_T = TypeVar("_T")

_BUFFER_DTYPES = {"f": "float32", "e": "float16", "bfloat16": "bfloat16"}


def _x_buffer(x: Any, hidden: int, x_dtype: str | None = None) -> tuple[memoryview, str]:
    """A zero-copy view of a layer input and its dtype name, checked for shape and layout.
    `x_dtype` names the elements when the buffer's format cannot (bfloat16 as 16-bit ints)."""
    try:
        view = memoryview(x)
    except TypeError:
        raise TypeError(
            f"x must be a numpy array or an evaluated mx.array, got {type(x).__name__}"
        ) from None
    if x_dtype is not None:
        if x_dtype not in _BUFFER_DTYPES.values():
            raise TypeError(f"x_dtype must be float32, float16 or bfloat16, got {x_dtype!r}")
        if view.itemsize != (4 if x_dtype == "float32" else 2):
            raise TypeError(f"x has {view.itemsize}-byte elements, not {x_dtype}")
        dtype: str | None = x_dtype
    else:
        dtype = _BUFFER_DTYPES.get(view.format.lstrip("<=@"))
    if dtype is None:
        raise TypeError(
            f"x must be float32, float16 or bfloat16, got buffer format {view.format!r}"
        )
    if view.ndim != 2 or view.shape is None or view.shape[1] != hidden:
        raise ValueError(f"x must have shape [T, {hidden}], got {list(view.shape or ())}")
    if not view.c_contiguous:
        raise ValueError("x must be C-contiguous")
    return view, dtype


def cuda_backend_unavailable() -> str:
    """Why Window(backend="cuda") cannot run here; "" when it can (no import of CUDA unless the
    build has strata_stream._cuda)."""
    import importlib

    try:
        mod = importlib.import_module("strata_stream._cuda")
    except ImportError:
        return ("this build of strata_stream has no CUDA backend (strata_stream._cuda: built "
                "without nvcc, or with STRATA_CUDA=OFF)")  # fmt: skip
    return str(mod.unavailable())


def _device_rows(a: Any, name: str, hidden: int, writable: bool = False) -> tuple[int, int]:
    """(device address, rows) of a float32 C-contiguous [T, hidden] GPU array, read from its
    __cuda_array_interface__ (a torch CUDA tensor, a CuPy array), checked for dtype, shape,
    layout and (for an output) writability. Which device holds it the backend checks."""
    try:
        cai = a.__cuda_array_interface__
    except (AttributeError, RuntimeError):  # torch: AttributeError off the GPU
        where = f" on {a.device}" if hasattr(a, "device") else ""
        raise ConfigError(
            f"{name} must be a CUDA array (with __cuda_array_interface__, such as a torch CUDA "
            f"tensor), got {type(a).__module__}.{type(a).__name__}{where}"
        ) from None
    if not isinstance(cai, dict) or "shape" not in cai or "data" not in cai:
        raise ConfigError(f"{name}: __cuda_array_interface__ has no shape or data")
    typestr = str(cai.get("typestr", ""))
    if typestr not in ("<f4", "=f4", "|f4"):
        raise ConfigError(f"{name} must be float32 (typestr '<f4'), got typestr {typestr!r}")
    shape = tuple(int(d) for d in cai["shape"])
    if len(shape) != 2 or shape[1] != hidden:
        raise ConfigError(f"{name} must have shape [T, {hidden}], got {list(shape)}")
    strides = cai.get("strides")
    if strides is not None:  # None: C-contiguous; a stride of a dimension of size 1 is moot
        s0, s1 = (int(v) for v in strides)
        if (shape[1] > 1 and s1 != 4) or (shape[0] > 1 and s0 != 4 * hidden):
            raise ConfigError(f"{name} must be C-contiguous, got strides {(s0, s1)} (bytes)")
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise ConfigError(f"{name} is read-only")
    return int(ptr), shape[0]


def profile_path(pack: Path) -> Path:
    """Where a pack's expert popularity profile lives: beside it, `<pack>.profile.npy`."""
    return pack.with_name(pack.name + ".profile.npy")


class Window(ProcessBound):
    """The MoE layers of one model, computed over an ExpertStream. As the stream, usable in the
    process that made it: after fork() a child's calls raise ForkedError (close() does nothing)."""

    def __init__(self, stream: ExpertStream, backend: str = "cpu", threads: int = 0) -> None:
        """backend: "cpu" (the reference, everywhere); "cuda" (an NVIDIA GPU, through the
        separate extension strata_stream._cuda built where nvcc exists; without it or without a
        GPU a ConfigError says which, docs/cuda.md); "metal" (macOS builds only; elsewhere a
        ConfigError says so); "auto" (Metal where a device exists and its kernels cover the pack
        and configuration, else CUDA where a GPU runs it and moce is off, else the CPU). The
        default stays "cpu" until the Metal backend has run on a Mac (docs/metal.md).
        threads: CPU kernel threads, 0 = one per core."""
        if not isinstance(stream, ExpertStream):
            raise TypeError(f"Window needs an ExpertStream, got {type(stream).__name__}")
        c = stream.config  # checked against the pack by the engine's Window
        from strata_stream import _core

        self.stream = stream
        self.n_layers = stream.n_layers
        self.hidden = stream._s.layout["hidden"]
        options = c.window_options()
        self._bind(_core.Window(stream._s, options, backend=backend, threads=threads))
        self.profile_path = profile_path(stream.path)
        self._persist = c.persist_profile
        if self._persist:
            self._load_profile()
        # _files_lock guards the trace file and _finished: the Python-side resources that
        # close() writes out once, whichever thread gets there first.
        self._files_lock = threading.Lock()
        self._finished = False
        self._trace = None if c.trace_path is None else open(c.trace_path, "w")  # noqa: SIM115
        if self._trace is not None:
            self._trace.write(strata_trace_header(self.n_layers, stream.n_experts, stream.top_k))
        stream._attach(self)

    @property
    def _w(self) -> _core.Window:
        """The native Window; ForkedError in a process forked after it was made."""
        native: _core.Window = self._bound()
        return native

    # ---- turns -------------------------------------------------------------------------------
    @contextmanager
    def turn(self) -> Iterator[Window]:
        """A turn: layer calls in order; protections span it; ends with no device work."""
        self._check_open()
        self._w.begin_turn()  # ends an implicit turn of this thread; TurnError if one is open
        try:
            yield self
        finally:
            self._w.end_turn()  # nothing when the turn already ended (an error, or close())
            self._flush_trace()

    def restart_pass(self) -> None:
        """End this thread's turn if it stopped part-way through the layers, so that the next
        call may start again at layer 0: a caller's forward pass that failed between two layer
        calls (in attention, say) leaves the turn open at a later layer. Nothing otherwise."""
        self._check_open()
        if self._w.in_turn and self._w.next_layer != 0:
            self._w.end_turn()
            self._flush_trace()

    # ---- the layer call ----------------------------------------------------------------------
    def moe(self, layer: int, x: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """MoE output of `layer` for x [T, hidden] (float32 or float16, C-contiguous)."""
        layer = self._layer_arg(layer)
        arr = self._input(x)
        # The engine keeps turn order and ownership (opening a turn at layer 0 outside one,
        # closing it after layer L-1) under its own lock: checks here would race other threads.
        out = self._w.moe(layer, arr)
        if layer == self.n_layers - 1 and not self._w.in_turn:
            self._flush_trace()
        return out

    # ---- externally routed calls (the model routes with its own gate) -------------------------
    @property
    def per_entry_unsupported(self) -> str:
        """Why `moe_routed(..., per_entry=True)` cannot run on this Window's backend; "" when
        it can."""
        return self._w.per_entry_unsupported

    def arithmetic_unsupported(self, x_dtype: str, layer: int | None = None) -> str:
        """Why `moe_routed(..., arithmetic="mlx")` cannot run for x of `x_dtype` ("bfloat16" or
        "float32") on this Window's backend and pack, at `layer` (every layer when None: a
        pack's formats may differ by layer); "" when it can."""
        return self._w.arithmetic_unsupported(x_dtype, layer)

    def moe_routed(
        self,
        layer: int,
        x: Any,
        ids: npt.ArrayLike,
        weights: npt.ArrayLike | None,
        pred1: npt.ArrayLike | None = None,
        pred2: npt.ArrayLike | None = None,
        *,
        arithmetic: str = "float32",
        weights_dtype: str = "float32",
        x_dtype: str | None = None,
        per_entry: bool = False,
    ) -> npt.NDArray[np.float32]:
        """MoE output of `layer` for x with the routing given: the model chose the experts.

        x: [T, hidden], C-contiguous, float32/float16 numpy or any buffer (an evaluated
        ``mx.array`` of float32, float16 or bfloat16 is read in place, without a copy).
        ids, weights: [T, top_k] expert ids and mixture weights. pred1 / pred2: [T, top_k] the
        experts the model's gates of layers layer+1 / layer+2 pick on this input (None: no
        prediction). Same handshake and expert passes as `moe`; moce must be off.

        arithmetic: "float32" (every output element one float32 dot product, rounded once) or
        "mlx": the operation order and roundings of MLX's CPU kernels for x's dtype (bfloat16
        or float32), so the result is bitwise what mlx-lm computes on the CPU; it needs the cpu
        backend and q4/q8 experts whose scales have x's dtype, or mxfp4 experts whose Linear
        biases (if any) have x's dtype (ConfigError otherwise).
        weights_dtype: the dtype of the model's mixture weights ("float32" or "bfloat16"; the
        weights are passed widened to float32): with "mlx", bfloat16 weights round each
        weighted expert output to bfloat16 as MLX does.
        x_dtype: the dtype of x's elements when its buffer format cannot name it (a torch
        bfloat16 tensor viewed as int16, say); None reads it from the buffer.
        per_entry: return [T, top_k, hidden], each entry's weighted expert output, unsummed
        (what an experts module returns to a block that mixes them itself); weights may then
        be None (each entry's expert output itself). Needs a backend whose expert outputs the
        host reads (`per_entry_unsupported`).
        """
        layer = self._layer_arg(layer)
        view, dtype = _x_buffer(x, self.hidden, x_dtype)
        # ids, weights and predictions (shapes, dtypes, expert ranges) and moce being off are
        # checked by the extension and the engine, once.
        return self._routed_call(
            layer,
            lambda: self._w.moe_routed(
                layer,
                view,
                dtype,
                ids,
                weights,
                pred1,
                pred2,
                arithmetic=arithmetic,
                weights_dtype=weights_dtype,
                per_entry=per_entry,
            ),
        )

    def moe_routed_device(
        self,
        layer: int,
        x: Any,
        ids: npt.ArrayLike,
        weights: npt.ArrayLike,
        out: Any,
        pred1: npt.ArrayLike | None = None,
        pred2: npt.ArrayLike | None = None,
        *,
        stream: int | None = None,
    ) -> None:
        """As `moe_routed`, with x and out on the backend's GPU (backend="cuda"): the backend
        reads x and writes the MoE output into out itself, with no copy through the host.

        x, out: float32 C-contiguous [T, hidden] GPU arrays (``__cuda_array_interface__``: a
        torch CUDA tensor, a CuPy array) on device 0, out writable and apart from x. x must be
        complete when the call is made (for torch, copying the ids and weights to the host
        synchronizes its stream, which completes x). ids, weights, pred1, pred2: host arrays as
        for `moe_routed`. Float32 arithmetic.

        Without `stream` the call returns once out is complete on the device, so any stream may
        read it then. With the caller's CUDA stream (``torch.cuda.current_stream().cuda_stream``;
        0 is the legacy default stream) it returns once the kernels are queued, and that stream
        waits for them on the device: work queued on it afterwards reads out complete, and
        neither x nor out may be written on any other stream until then. The layer's slots stay
        protected until the next call, `begin_turn`, `end_turn` or `close` drains the backend
        (`completion_pending`). The cuda backend's device arena only; elsewhere the call waits
        as without it. ConfigError names the cause for an array or stream that is not one of
        these, and on a backend that computes from host memory only (the cpu one).
        """
        layer = self._layer_arg(layer)
        if stream is not None and (
            isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or stream < 0
        ):
            raise ConfigError(f"stream must be a CUDA stream handle (an int >= 0), got {stream!r}")
        x_ptr, rows = _device_rows(x, "x", self.hidden)
        out_ptr, out_rows = _device_rows(out, "out", self.hidden, writable=True)
        if out_rows != rows:
            raise ConfigError(f"out has {out_rows} rows, x has {rows}")
        # A backend that computes from host memory only is refused by the engine, which asked
        # it once at construction.
        self._routed_call(
            layer,
            lambda: self._w.moe_routed_device(
                layer,
                x_ptr,
                out_ptr,
                rows,
                ids,
                weights,
                pred1,
                pred2,
                None if stream is None else int(stream),
            ),
        )

    def moe_routed_external(
        self,
        layer: int,
        ids: npt.ArrayLike,
        compute: Callable[[int, int, npt.NDArray[np.uint32]], None],
        pred1: npt.ArrayLike | None = None,
        pred2: npt.ArrayLike | None = None,
    ) -> None:
        """The same handshake, with the experts computed by the caller (the MLX-kernel path;
        on a Mac MLX computes them on the GPU). Nothing runs on this Window's backend.

        For every wave the engine calls ``compute(row0, rows, slots)``: slots [rows, top_k]
        uint32 gives the arena slot of each entry of rows [row0, row0 + rows) whose expert is in
        this wave, ABSENT (0xFFFFFFFF) for the others; those slots hold their experts until
        compute returns (read them through `ExpertStream.arena_view`). Each entry is in exactly
        one wave. An exception from compute abandons the turn and propagates.
        """
        layer = self._layer_arg(layer)
        self._routed_call(
            layer, lambda: self._w.moe_routed_external(layer, ids, pred1, pred2, compute)
        )

    @property
    def backend(self) -> str:
        """The backend's name ("cpu", "cuda", "metal")."""
        return str(self._w.backend)

    @property
    def completion_pending(self) -> bool:
        """Whether the last call returned with its kernels still queued (`moe_routed_device`
        with a stream): its layer's slots stay protected until the next call, `begin_turn`,
        `end_turn` or `close` waits for the backend. False on a closed Window."""
        return bool(self._w.completion_pending)

    def wants_predictions(self, layer: int, rows: int) -> tuple[bool, bool]:
        """Which predictions an externally routed call (`moe_routed` or `moe_routed_external`)
        of `rows` rows at `layer` uses: (router layer+1, router layer+2) on this layer's input.
        The engine decides (lookahead, the two-layer flags for decode-sized and larger calls,
        the last layers); a caller runs only the gates it names and passes None for the rest."""
        layer = self._layer_arg(layer)
        nxt, two = self._w.wants_predictions(layer, rows)
        return bool(nxt), bool(two)

    @property
    def in_turn(self) -> bool:
        """Whether a turn is open (this thread's or another's); False on a closed Window."""
        return not self.closed and bool(self._w.in_turn)

    @property
    def next_layer(self) -> int:
        """The layer the open turn calls next (0 outside a turn)."""
        return 0 if self.closed else int(self._w.next_layer)

    def pass_layer(self, layer: int) -> None:
        """Move the turn past `layer`, which this pass runs no rows of: a decoder layer with
        several experts sets (one pack layer each) whose pass's tokens chose none of this one,
        where the turn's order still holds every pack layer. Its predicted reads go to limbo as
        a call's unchosen ones do; at layer 0 it opens the turn, at the last layer it ends it,
        as a call would; out of order it is a TurnError, as a call's."""
        layer = self._layer_arg(layer)
        self._routed_call(layer, lambda: self._w.pass_layer(layer))

    def _layer_arg(self, layer: int) -> int:
        """The layer argument of a layer call, checked: an open Window, an int in range."""
        self._check_open()
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= int(layer) < self.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.n_layers})")
        return int(layer)

    def _routed_call(self, layer: int, call: Callable[[], _T]) -> _T:
        # As moe(): the engine keeps turn order and ownership under its own lock.
        out = call()
        if layer == self.n_layers - 1 and not self._w.in_turn:
            self._flush_trace()
        return out

    def route_residency(self) -> tuple[int, npt.NDArray[np.bool_]] | None:
        """(layer, resident [n_experts]) as the last moce route read it from smap: which
        experts of that layer had a published slot. None when moce is off or nothing was routed.
        A layer call routes each chunk of at most max_rows rows; this is the last chunk's."""
        if self._w.route_layer < 0:
            return None
        return self._w.route_layer, self._w.route_resident()

    def _load_profile(self) -> None:
        if not self.profile_path.exists():
            return
        try:
            counts = np.load(self.profile_path)
            if counts.shape != (self.n_layers, self.stream.n_experts):
                raise ValueError(f"shape {counts.shape}")
            self._w.set_profile(counts.astype(np.uint32).ravel())
        except (OSError, ValueError, TypeError) as err:  # a stale or foreign file: learn afresh
            warnings.warn(f"ignoring expert profile {self.profile_path}: {err}", stacklevel=3)

    def profile(self) -> npt.NDArray[np.uint32]:
        """Tokens that chose each expert, [n_layers, n_experts], learned online."""
        return self._w.profile().reshape(self.n_layers, -1)

    def save_profile(self) -> None:
        """Writes the profile beside the pack (atomically); close() does it too. Each writer has
        a temporary of its own: Windows on one pack (in threads or processes) save side by side,
        the last rename wins. Nothing is written (and nothing said) where the pack's directory
        is read-only; another failure to write is a warning."""
        if not os.access(self.profile_path.parent, os.W_OK):
            # A read-only pack directory (a shared or mounted cache): the profile cannot persist
            # there, by the directory's owner's choice; nothing is lost but the head start.
            return
        tmp = unique_temporary(self.profile_path)
        try:
            with open(tmp, "wb") as f:
                np.save(f, self.profile())
            os.replace(tmp, self.profile_path)
        except OSError as err:  # a read-only pack directory costs the profile, nothing else
            with suppress(OSError):
                tmp.unlink()
            warnings.warn(f"cannot save expert profile {self.profile_path}: {err}", stacklevel=2)

    def _flush_trace(self) -> None:
        with self._files_lock:
            if self._trace is None or self._finished:
                return
            routes = self._w.take_routes()
            self._trace.write(strata_trace_rows(routes.tolist()))
            self._trace.flush()

    def _input(self, x: npt.ArrayLike) -> npt.NDArray[np.float32]:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a numpy array, got {type(x).__name__}")
        if x.dtype not in (np.float32, np.float16):
            raise TypeError(f"x must be float32 or float16, got {x.dtype}")
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must have shape [T, {self.hidden}], got {list(x.shape)}")
        if not x.flags.c_contiguous:
            raise ValueError("x must be C-contiguous (np.ascontiguousarray(x))")
        return x if x.dtype == np.float32 else x.astype(np.float32)

    # ---- stats and lifecycle -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-layer and total figures: hits, misses, bytes read, stall and handshake seconds,
        prediction precision and recall at distance 1, and for moce the router probability mass
        moved off the true top-k (summed over tokens), how many true top-k choices it replaced,
        and the seconds spent settling IO for deterministic moce routing;
        under "prefetch", the back-off governor: state (open, throttled, closed, probing;
        "disabled" with backoff off), cap (new speculative reads per handshake, None =
        unlimited), its judgements so far and the precision and busy fraction of the last one;
        "backend_tuning": the backend's tuning as it read it when made (docs/settings.md), in
        words, "" for a backend with none (the cpu one)."""
        layers: list[dict[str, Any]] = [dict(d) for d in self._w.layer_stats()]
        for d in layers:
            d["precision"] = (
                d["pred_correct"] / d["pred_predicted"] if d["pred_predicted"] else None
            )
            d["recall"] = d["pred_correct"] / d["pred_actual"] if d["pred_actual"] else None
        total: dict[str, Any] = {
            k: sum(d[k] for d in layers)
            for k in (
                "calls",
                "tokens",
                "hits",
                "misses",
                "bytes_read",
                "stall_seconds",
                "handshake_seconds",
                "handshake_cpu_seconds",
                "waves",
                "pred_correct",
                "pred_predicted",
                "pred_actual",
                "moce_moved_mass",
                "moce_changed",
                "settle_seconds",
            )
        }
        looked = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / looked if looked else None
        total["precision"] = (
            total["pred_correct"] / total["pred_predicted"] if total["pred_predicted"] else None
        )
        total["recall"] = (
            total["pred_correct"] / total["pred_actual"] if total["pred_actual"] else None
        )
        return {
            "layers": layers,
            "total": total,
            "scratch_bytes": self._w.scratch_bytes,
            "backend": self._w.backend,
            "backend_tuning": self._w.backend_tuning,
            "prefetch": dict(self._w.prefetch_stats()),
        }

    def reset_stats(self) -> None:
        self._w.reset_stats()

    def close(self) -> None:
        """Waits for a layer call in flight on another thread, fails its turn (the owner's next
        call raises StreamClosedError), frees the device thread, its pool and the scratch, then
        writes the trace and the profile. Idempotent and safe from any thread; stats() and
        profile() stay readable. In a process forked after the Window was made it does nothing."""
        if self._inherited:
            return
        self._w.close()
        with self._files_lock:
            if self._finished:
                return
            self._finished = True
            trace, self._trace = self._trace, None
            if trace is not None:
                trace.write(strata_trace_rows(self._w.take_routes().tolist()))
                trace.close()
        if self._persist:
            self.save_profile()

    @property
    def closed(self) -> bool:
        return self._w.closed

    def _check_open(self) -> None:
        if self._w.closed:
            raise StreamClosedError("Window is closed")
        if self.stream.closed:
            raise StreamClosedError("the Window's ExpertStream is closed")

    def __enter__(self) -> Window:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
