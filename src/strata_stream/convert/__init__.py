"""Convert a model checkpoint's routed experts into a pack (`strata-stream convert`).

    from strata_stream.convert import convert
    convert("path/to/mlx-model", "model.strpk")

The experts are copied byte for byte (q4/q8/mxfp4 words, scales and biases in their dtype,
float weights) one expert at a time, each read with one pread per tensor from the parsed safetensors
headers: no tensor and no model is ever loaded whole, so peak memory is a few records. The pack
routes "externally": the model keeps its own gate (strata_stream.mlx_lm), so no router is stored.

`quantize="q4" | "q8"` instead writes a quantized pack from a float (f32/f16/bf16) checkpoint:
each expert is read, quantized (MLX's affine scheme, `pack.quant.quantize`) and written before
the next is read, so memory stays a few records. This is lossy: the pack holds the quantized
weights, not the checkpoint's, and a model loaded with it computes with those.
"""

from __future__ import annotations

import os
from pathlib import Path

from strata_stream.convert.checkpoint import ExpertLayout, find_experts, read_config, share_layout
from strata_stream.convert.safetensors_index import SafetensorsIndex
from strata_stream.convert.share import WHOLE, Share
from strata_stream.convert.source import (
    TensorDigests,
    final_record,
    placeholder_record,
    shard_signatures,
)
from strata_stream.errors import ConfigError
from strata_stream.pack.header import MAGIC
from strata_stream.pack.writer import write_pack

QUANTIZE_FORMATS = ("q4", "q8")
_FLOAT_FORMATS = ("f32", "f16", "bf16")


def inspect_checkpoint(model_dir: str | os.PathLike[str]) -> ExpertLayout:
    """Where a checkpoint's experts are and how they are stored, without reading them."""
    with SafetensorsIndex(model_dir) as index:
        return find_experts(Path(model_dir), index)


def _is_pack(path: Path) -> bool:
    """Whether `path` begins as a pack does (of any model; a damaged one included)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def check_output(out: str | os.PathLike[str], force: bool = False) -> Path:
    """`out` as a pack to write, checked before anything is converted; ConfigError naming the
    path as given when it is a directory, its directory does not exist, or it is a file that is
    not a pack (replaced only with `force`: nothing but a pack is ever overwritten unasked)."""
    path = Path(out)
    typed = os.fspath(out)
    if path.is_dir():
        raise ConfigError(
            f"{typed}: is a directory; name the pack file to write, such as {path / 'model.strpk'}"
        )
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{typed}: no such directory {parent}")
    if (path.exists() or path.is_symlink()) and not force and not _is_pack(path):
        raise ConfigError(
            f"{typed}: the file exists and is not a strata-stream pack; refusing to "
            "overwrite it (name another file, or add --force to replace it)"
        )
    return path


def convert(
    model_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    progress: bool = True,
    share: Share = WHOLE,
    quantize: str | None = None,
    group_size: int = 64,
    force: bool = False,
) -> Path:
    """Pack the routed experts of the checkpoint in `model_dir` into `out`; returns the path.

    `share`: one rank's part under MLX distributed (strata_stream.convert.share): only the
    experts of its decoder layers, renumbered from pack layer 0, and/or its slice of every
    expert's intermediate dimension; recorded in the pack's "model" metadata.
    `quantize`: "q4" or "q8" quantizes float experts on the way, in groups of `group_size` (32,
    64 or 128) with scales in the checkpoint's dtype (lossy, see above).
    `out` must not be a directory, its directory must exist, and an existing file there is
    replaced only when it is a pack, or with `force` (check_output, before anything is read).
    The pack is written in a staging directory beside `out` and appears at `out` only once it
    is complete (pack/staging.py).
    Raises ConfigError for a checkpoint it cannot convert (naming why: no experts, a format
    the pack cannot hold) and PackError for malformed safetensors files.
    """
    model_dir = Path(model_dir)
    out_path = check_output(out, force)
    if quantize is not None:
        if quantize not in QUANTIZE_FORMATS:
            raise ConfigError(
                f"quantize must be one of {', '.join(QUANTIZE_FORMATS)}, got {quantize!r}"
            )
        if group_size not in (32, 64, 128):
            raise ConfigError(f"group_size must be 32, 64 or 128, got {group_size}")
    with SafetensorsIndex(model_dir) as index:
        layout = share_layout(find_experts(model_dir, index), share)
        weight_format, group, scale_dtype = (
            layout.weight_format, layout.group_size or 64, layout.scale_dtype or "f16"
        )  # fmt: skip
        if quantize is not None:
            if layout.layer_formats:
                raise ConfigError(
                    f"{model_dir}: the experts are stored in formats that differ by layer or "
                    "matrix (already quantized); --quantize takes float (f32, f16, bf16) "
                    "checkpoints"
                )
            if layout.weight_format not in _FLOAT_FORMATS:
                raise ConfigError(
                    f"{model_dir}: the experts are already {layout.weight_format}; --quantize "
                    "takes float (f32, f16, bf16) checkpoints"
                )
            g = layout.geometry
            for width in (g.hidden, g.moe_intermediate):
                if width % group_size:
                    raise ConfigError(
                        f"{model_dir}: the experts' width {width} is not a multiple of the "
                        f"group size {group_size}"
                    )
            weight_format, group, scale_dtype = quantize, group_size, layout.weight_format
        # What the pack is made from (convert/source.py): the shards' identity now, and the
        # digest of every expert tensor's bytes as they are read.
        shards = shard_signatures(model_dir)
        placeholder = {**layout.model, "source_weights": placeholder_record(shards, layout)}
        # write_pack writes in a staging directory of its own and renames the pack onto
        # out_path once complete (pack/staging.py).
        with TensorDigests(layout) as digests:
            write_pack(
                out_path,
                layout.geometry,
                None,
                layout.experts_fn(index, digests.update),
                weight_format=weight_format,
                group_size=group,
                scale_dtype=scale_dtype,
                architecture=layout.model_type,
                source=str(model_dir.resolve()),
                progress=progress,
                bias_dtype=layout.bias_dtype,
                model=placeholder,
                layer_formats=layout.layer_formats if quantize is None else (),
                final_model=lambda: {
                    **layout.model,
                    "source_weights": final_record(shards, digests),
                },
            )
    return out_path


__all__ = [
    "QUANTIZE_FORMATS",
    "ExpertLayout",
    "SafetensorsIndex",
    "Share",
    "check_output",
    "convert",
    "inspect_checkpoint",
    "read_config",
]
