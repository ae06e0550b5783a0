"""Which engine can read a checkpoint, and what `generate` says when the chosen one cannot.

mlx-lm writes its quantized checkpoints with its own `quantization` config (bits, group size,
mode) that transformers cannot read; mlx-lm builds a model from its own ModelArgs, which may
reject a config a newer transformers saved (renamed or moved fields). Either mismatch is a
CheckpointError naming the checkpoint and the engine that reads it, so the CLI can say so in
one line, or run that engine where the user did not choose one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from strata_stream.errors import CheckpointError


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def mlx_quantization(model_dir: Path) -> str:
    """"4-bit, group 64" for a checkpoint mlx-lm quantized (its `quantization` config, which no
    transformers quantizer claims: no quant_method); "" otherwise."""
    config = _config(model_dir)
    q = config.get("quantization")
    hf = config.get("quantization_config")
    if not isinstance(q, dict) or (isinstance(hf, dict) and "quant_method" in hf):
        return ""
    return f"{q.get('bits', '?')}-bit, group {q.get('group_size', '?')}"


def check_transformers_can_read(model_dir: Path) -> None:
    """CheckpointError (engine "mlx-lm") for an mlx-lm quantized checkpoint."""
    quant = mlx_quantization(model_dir)
    if quant:
        raise CheckpointError(
            f"{model_dir / 'config.json'}: an mlx-lm quantized checkpoint ({quant}), which "
            "transformers cannot read: run it with --engine mlx-lm",
            engine="mlx-lm",
        )


def _raised_in_mlx_lm(err: BaseException) -> bool:
    """Whether `err` was raised inside mlx-lm's own code (its model classes reading a config),
    not in strata-stream's."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and f"{os.sep}mlx_lm{os.sep}" in last


def mlx_lm_cannot_build(err: BaseException, model: str) -> CheckpointError | None:
    """The CheckpointError (engine "transformers") for an error mlx-lm raised building the model
    from its config; None for any other error (left to propagate as it is)."""
    if not isinstance(err, (TypeError, KeyError, ValueError, AttributeError)):
        return None
    if not _raised_in_mlx_lm(err):
        return None
    config = _config(Path(model))
    saved = config.get("transformers_version")
    by = f", saved by transformers {saved}" if isinstance(saved, str) else ""
    reason = " ".join(str(err).split()) or type(err).__name__
    return CheckpointError(
        f"{Path(model) / 'config.json'}: mlx-lm cannot build this {config.get('model_type', '')} "
        f"model from its config ({reason}{by}): run it with --engine transformers",
        engine="transformers",
    )


class Lines:
    """A text sink that knows whether its last line is complete, so that an error raised while
    text is being printed starts on a line of its own (`with Lines(out) as sink: ...`)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.open_line = False

    def write(self, text: str) -> int:
        if text:
            self.open_line = not text.endswith("\n")
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def __enter__(self) -> Lines:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if e is not None and self.open_line:
            self.out.write("\n")
            self.out.flush()
            self.open_line = False


__all__ = [
    "Lines",
    "check_transformers_can_read",
    "mlx_lm_cannot_build",
    "mlx_quantization",
]
