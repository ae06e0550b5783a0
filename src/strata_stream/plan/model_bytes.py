"""A model's dense and expert bytes, and the pack it would convert to, from headers alone.

The checkpoint's safetensors headers (a local directory's files, or the Hugging Face hub's
metadata API, which reads each shard's header with a range request) say every tensor's dtype,
shape and size; the converter's own reading of them (convert/checkpoint.py find_experts) says
which are routed experts and in what format, and the pack header (pack/header.py) says how
large a record, its stride and the file are. No weight is read or downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from strata_stream.convert.checkpoint import ExpertLayout, find_experts
from strata_stream.convert.safetensors_index import SafetensorsIndex, TensorLocation
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack.geometry import Geometry
from strata_stream.pack.header import FLOAT_FORMATS, PackHeader, build_header
from strata_stream.paths import model_location

# The input embedding and a separate output head, by the names the families give them.
_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings)\.")
_HEAD = re.compile(r"(^|\.)(lm_head|output)\.weight$")

# The quantizations `strata-stream convert --quantize` offers a float checkpoint, at its
# default group size.
QUANTIZED = ("q8", "q4")
QUANTIZE_GROUP = 64


@dataclass(frozen=True)
class PackFormat:
    """One way the experts could be packed: its name, record size, stride and pack size."""

    name: str  # "bf16", "q4 g64" ... ; "as stored" formats are the checkpoint's own
    converted_by: str  # "convert" (the checkpoint's own format) or "convert --quantize q4"
    record_bytes: int
    record_stride: int
    pack_bytes: int


@dataclass(frozen=True)
class ModelBytes:
    source: str  # the local directory or the hub repo
    model_type: str
    geometry: Geometry
    dense_bytes: int  # every tensor that is not a routed expert, as stored
    expert_bytes: int  # the routed experts' tensors as stored
    # The input embedding, where the model has a separate output head (lm_head): a token reads
    # one row of it, not all of it. 0 where the head is the embedding (tied), read whole.
    embedding_bytes: int
    formats: tuple[PackFormat, ...]  # the first is what `convert` writes

    @property
    def pack(self) -> PackFormat:
        return self.formats[0]


class HeaderIndex(SafetensorsIndex):
    """A SafetensorsIndex of tensors known from their headers alone, with no file open: what
    find_experts reads (names, dtypes, shapes, sizes). Reading a tensor's data is refused."""

    def __init__(self, directory: Path, tensors: dict[str, TensorLocation]) -> None:
        self.directory = directory
        self.tensors = tensors
        self._fds = {}

    def _pread(self, loc: TensorLocation, offset: int, n: int, what: str) -> bytes:
        raise PackError(f"{loc.file}: {what}: plan reads headers only")


def _hub_index(repo: str) -> tuple[Path, HeaderIndex]:
    """config.json (a small file, fetched into the hub's cache) and every shard's header."""
    try:
        from huggingface_hub import get_safetensors_metadata, hf_hub_download
    except ImportError:
        raise ConfigError(
            f"{repo}: not a local directory, and reading its metadata from the Hugging Face hub "
            "needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        config = Path(hf_hub_download(repo, "config.json"))
        meta = get_safetensors_metadata(repo)
    except Exception as e:  # noqa: BLE001 - the hub's errors have no common base but Exception
        raise ConfigError(f"{repo}: cannot read its metadata from the hub: {e}") from None
    tensors: dict[str, TensorLocation] = {}
    for filename, info in meta.files_metadata.items():
        for name, t in info.tensors.items():
            begin, end = t.data_offsets
            tensors[name] = TensorLocation(
                Path(filename), t.dtype, tuple(t.shape), begin, end - begin
            )
    if not tensors:
        raise ConfigError(f"{repo}: the hub lists no safetensors tensors")
    return config.parent, HeaderIndex(config.parent, tensors)


def expert_tensor_names(layout: ExpertLayout) -> set[str]:
    """Every checkpoint tensor that holds routed experts (a per-expert layout's names expanded
    for each expert; a fused tensor named once)."""
    names: set[str] = set()
    for layer in layout.layers:
        for name in layer.names.values():
            if "{e}" in name:
                names.update(name.format(e=e) for e in range(layout.geometry.n_experts))
            else:
                names.add(name)
    return names


def _format(name: str, by: str, header: PackHeader) -> PackFormat:
    return PackFormat(name, by, header.record_bytes, header.record_stride, header.file_bytes)


def pack_formats(layout: ExpertLayout, source: str) -> tuple[PackFormat, ...]:
    """The pack `convert` writes, then (for float experts) those `convert --quantize` would."""
    header, _ = build_header(
        layout.geometry,
        layout.weight_format,
        layout.group_size,
        layout.scale_dtype,
        layout.model_type,
        source,
        layout.bias_dtype,
        layout.model,
        layout.layer_formats,
    )
    if layout.layer_formats:
        stored = "mixed: " + ", ".join(
            sorted({f.describe() for lf in layout.layer_formats for f in lf})
        )
    else:
        stored = layout.formats_of(0)[0].describe()
    out = [_format(stored, "convert", header)]
    g = layout.geometry
    if (
        not layout.layer_formats
        and layout.weight_format in FLOAT_FORMATS
        and g.hidden % QUANTIZE_GROUP == 0
        and g.moe_intermediate % QUANTIZE_GROUP == 0
    ):
        for q in QUANTIZED:
            header, _ = build_header(
                g,
                q,
                QUANTIZE_GROUP,
                layout.weight_format,
                layout.model_type,
                source,
                layout.bias_dtype,
                layout.model,
            )
            out.append(_format(f"{q} g{QUANTIZE_GROUP}", f"convert --quantize {q}", header))
    return tuple(out)


def model_bytes(model: str) -> ModelBytes:
    """Reads a local checkpoint directory's headers, or a hub repo's metadata. ConfigError or
    PackError naming what is wrong (no config.json, no routed experts, a format the pack
    cannot hold)."""
    location = model_location(model)
    local = Path(location)
    if local.exists():
        if not local.is_dir():
            raise ConfigError(f"{location}: not a model directory")
        with SafetensorsIndex(local) as index:
            layout = find_experts(local, index)
            tensors = dict(index.tensors)
    else:
        directory, header_index = _hub_index(location)
        layout = find_experts(directory, header_index)
        tensors = header_index.tensors
    experts = expert_tensor_names(layout)
    missing = sorted(experts - tensors.keys())
    if missing:  # a per-expert layout with a hole: the converter would refuse it too
        raise PackError(f"{location}: expert tensor {missing[0]} is missing")
    expert_bytes = sum(tensors[n].nbytes for n in experts)
    dense_bytes = sum(t.nbytes for n, t in tensors.items() if n not in experts)
    embedding = 0
    if any(_HEAD.search(n) for n in tensors):
        embedding = sum(t.nbytes for n, t in tensors.items() if _EMBEDDING.search(n))
    return ModelBytes(
        location,
        layout.model_type,
        layout.geometry,
        dense_bytes,
        expert_bytes,
        embedding,
        pack_formats(layout, location),
    )


__all__ = [
    "HeaderIndex",
    "ModelBytes",
    "PackFormat",
    "expert_tensor_names",
    "model_bytes",
    "pack_formats",
]
