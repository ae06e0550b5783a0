"""The routed experts of an mlx-lm (or Hugging Face) checkpoint: where they are, in what format.

Two layouts are recognised, by tensor name, whatever the family:

- stacked (mlx-lm): ``...layers.{i}.{path}.{switch_mlp|switch_glu|experts}.{gate,up,down}_proj.
  {role}`` (the experts module where the model holds it: ``mlp.switch_mlp``, gemma4's
  ``experts.switch_glu``, deepseek_v41's ``mlp.experts.switch_mlp``, step3p7's ``moe``) with
  a leading expert axis ``[E, rows, cols]``; role ``weight`` (uint32 when quantized),
  ``scales``/``biases`` (affine quantization), ``bias`` (the Linear's own, gpt-oss);
- per expert (Hugging Face): ``...layers.{i}.{path}.experts.{e}.{gate,up,down}_proj.{role}``
  (Mixtral's ``w1``/``w3``/``w2`` are gate/up/down);
- fused (transformers 5): ``...layers.{i}.{path}.experts.gate_up_proj`` and ``.down_proj``
  (float weights), with ``_bias`` tensors where the experts have Linear biases. Two
  orientations, told apart by which axis is hidden_size: ``gate_up_proj [E, 2I, H]`` (gate rows,
  then up rows) with ``down_proj [E, H, I]``, as transformers 5's experts modules hold them; and
  gpt-oss's ``gate_up_proj [E, H, 2I]`` (gate and up interleaved column by column) with
  ``down_proj [E, I, H]``, as its save_pretrained writes them. Names and shapes cannot tell that
  interleaving from gate columns then up columns (openai_privacy_filter's): the split is the
  experts module's own (`ColumnsSplit`: the caller's, else read from transformers' experts
  module built from config.json, else assumed interleaved and recorded as assumed). Each expert
  is one pread of the fused tensor, split and transposed into the pack's [rows, cols] matrices.
  gpt-oss's published mxfp4 checkpoints hold ``gate_up_proj_blocks [E, 2I, H/32, 16]`` (uint8,
  two E2M1 codes a byte, the low nibble first: MLX's mxfp4 words, byte for byte) and ``_scales
  [E, 2I, H/32]`` (E8M0) with gate and up interleaved row by row, and ``down_proj_blocks [E, H,
  I/32, 16]``: copied as they are, the rows split. inkling's ``experts.w13_weight [E, 2I, H]``
  (gate and up rows interleaved) with ``w2_weight [E, H, I]`` is the rows orientation with gate
  and up rows alternating. Fused experts may work at a width of their own (muse_spark's
  moe_hidden_size): where hidden_size fits neither orientation the shapes alone decide, and the
  pack's hidden size is the experts'. Gateless experts as a bare stacked pair, ``up_proj`` and
  ``down_proj`` without ``.weight`` (ergo's ``feed_forward.up_proj [E, H, I]`` with ``down_proj
  [E, I, H]``, or ``[E, I, H]`` with ``[E, H, I]``), are read likewise, told apart by
  hidden_size.

Each experts module is one pack layer, in the order of (decoder layer, experts prefix): a decoder
layer may hold several (ERNIE-4.5-VL's text and vision experts). Where a checkpoint lists several
modules' experts as one per-expert list (ERNIE-4.5-VL's ``mlp.experts.{e}``: the text experts,
then the vision ones), a list of k times the experts config.json gives one module is k sets of
consecutive experts (`_split_sets`), each its own pack layer; the pack's model block records
each set's first expert in the list (`expert_offsets`).

Quantization is read from the shapes (bits = packed words * 32 / input width, group = input
width / scale columns), per matrix and per layer, so per-layer overrides in config.json need no
special handling: matrices stored in different formats (mlx-lm's quantization predicates) make
a version 3 pack, each in its own format.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from strata_stream.convert.safetensors_index import SafetensorsIndex
from strata_stream.convert.share import WHOLE, Share
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack.geometry import Geometry
from strata_stream.pack.header import (
    MATRICES,
    QUANT_FORMAT_BITS,
    ROLES,
    LayerFormat,
    MatrixFormat,
    layer_record_layout,
)
from strata_stream.pack.quant import QuantizedMatrix, bf16_bits_to_f32

_STACKED = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)"
    r"(?P<module>switch_mlp|switch_glu|experts|moe))"
    r"\.(?P<mat>gate_proj|up_proj|down_proj)\.(?P<role>weight|scales|biases|bias)$"
)
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)experts)\.(?P<expert>\d+)"
    r"\.(?P<mat>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<role>weight|scales|biases|bias)$"
)
_FUSED = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)experts)"
    r"\.(?P<mat>gate_up_proj|down_proj)(?P<suffix>_bias|_blocks|_scales)?$"
)
# granitemoe's checkpoints (transformers writes them so): the same fused pair as Linear-style
# parameters of the MoE block, input_linear [E, 2I, H] (gate rows, then up rows) and
# output_linear [E, H, I].
_FUSED_LINEAR = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)\w+)"
    r"\.(?P<mat>input_linear|output_linear)\.weight$"
)
# aria's checkpoints: experts.fc1 [E, H, 2I] (gate columns, then up columns: concatenated, not
# gpt-oss's interleaving) and experts.fc2 [E, I, H].
_FUSED_FC = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)experts)"
    r"\.(?P<mat>fc1|fc2)\.weight$"
)
# inkling's checkpoints: experts.w13_weight [E, 2I, H] (gate and up rows interleaved, row 2i
# gate and 2i+1 up: transformers' conversion mapping de-interleaves them into gate_up_proj) and
# experts.w2_weight [E, H, I].
_FUSED_W13 = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)experts)"
    r"\.(?P<mat>w13|w2)_weight$"
)
# Gateless experts as two stacked parameters without a Linear's ``.weight``: ergo's checkpoints'
# feed_forward.up_proj [E, H, I] with down_proj [E, I, H] (transformers' conversion mapping
# renames them experts.up_proj), or transformers' own experts.up_proj [E, I, H] with
# down_proj [E, H, I]. Only 3-D tensors are experts; the orientation is read from the shapes.
_FUSED_UP = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>(?:\w+\.)*?)\w+)"
    r"\.(?P<mat>up_proj|down_proj)$"
)
# Their fp8 variants' per-expert scales, which the converter does not apply.
_W13_SCALED = re.compile(r"(?:^|\.)experts\.w(?:13|2)_weight_\w+$")
_FUSED_NAMES = {
    "w13": "gate_up_proj",
    "w2": "down_proj",
    "input_linear": "gate_up_proj",
    "output_linear": "down_proj",
    "fc1": "gate_up_proj",
    "fc2": "down_proj",
}
# Stacked experts of one input projection (mlx-lm's SwitchMLP: fc1, activation, fc2).
_UNGATED = re.compile(r"(?:^|\.)switch_mlp\.fc1\.weight$")
_MATRIX = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}
_FLOAT_FORMATS = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
# How a fused gate_up_proj [E, H, 2I] holds gate and up: interleaved column by column (gpt-oss)
# or gate columns then up columns (openai_privacy_filter). Its name and shape are the same
# either way; transformers' experts module says which (experts_interface.declared_concatenated).
ColumnsSplit = Literal["interleaved", "halves"]
# What a checkpoint whose experts module cannot be built is taken to hold (gpt-oss's).
ASSUMED_COLUMNS_SPLIT: ColumnsSplit = "interleaved"
# gpt-oss's clamped SwiGLU (mlx_lm.models.activations.SwigluOAI defaults).
_OAI_ALPHA, _OAI_LIMIT = 1.702, 7.0


# The config keys families name the routed experts per token by, in the order they are read.
_TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_top_k",
    "top_k_experts",
    "moe_k",
    "n_activated_experts",
    "experts_per_token",
    "top_k",
    "topk",
)


def _top_k(config: dict[str, Any]) -> int:
    for key in _TOP_K_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{model_dir}: no config.json (not a model directory?)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    # Multimodal wrappers keep the language model's settings under text_config.
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    return config


@dataclass
class _Layer:
    decoder_layer: int
    prefix: str
    stacked: bool
    # (matrix, role) -> tensor name; per-expert names hold "{e}" for the expert index.
    names: dict[tuple[int, str], str] = field(default_factory=dict)
    # Fused tensors (stacked is then True): "rows" for gate_up_proj [E, 2I, H] (gate rows, then
    # up rows), "columns" for gpt-oss's [E, H, 2I] (interleaved columns), "columns_halves" for
    # aria's experts.fc1 [E, H, 2I] and openai_privacy_filter's gate_up_proj [E, H, 2I] (gate
    # columns, then up columns: the experts module's split, see find_experts), "blocks" for
    # gpt-oss's mxfp4 *_blocks / *_scales (interleaved rows), "rows_interleaved" for inkling's
    # w13_weight [E, 2I, H] (gate and up rows alternate); None otherwise.
    fused: str | None = None
    # A per-expert list that holds several experts sets of one decoder layer (`_split_sets`):
    # this set's first expert in the list; 0 otherwise.
    offset: int = 0
    size: int = 0  # its experts (0: every expert the list holds)


@dataclass(frozen=True)
class ExpertLayout:
    """The routed experts of one checkpoint, ready to be packed."""

    model_type: str
    geometry: Geometry
    weight_format: str  # pack name: f32, f16, bf16, q4, q8
    group_size: int
    scale_dtype: str | None
    bias_dtype: str | None
    layers: tuple[_Layer, ...]
    model: dict[str, Any]
    # This rank's share; the geometry and `layers` are already the share's. `rows` is the slice
    # of the checkpoint's intermediate dimension it holds.
    share: Share = WHOLE
    rows: tuple[int, int] | None = None
    # Each layer's (gate, up, down) formats where they differ by layer or matrix (a version 3
    # pack); empty when every matrix is in weight_format.
    layer_formats: tuple[LayerFormat, ...] = ()

    def formats_of(self, pack_layer: int) -> LayerFormat:
        if self.layer_formats:
            return self.layer_formats[pack_layer]
        one = MatrixFormat(self.weight_format, self.group_size, self.scale_dtype)
        return (one, one, one)

    def tensor_names(self) -> list[str]:
        """The checkpoint names of the expert tensors `experts_fn` reads, in record order (a
        per-expert layout's names hold "{e}" for the expert index)."""
        return [name for layer in self.layers for _, name in sorted(layer.names.items())]

    def experts_fn(
        self, index: SafetensorsIndex, digest: Callable[[str, Any], None] | None = None
    ) -> Callable[[int, int], tuple[Any, ...]]:
        """experts(layer, e) for write_pack: one expert's tensors, read one pread each (gate
        and up: just the share's rows; down: the whole expert, its share's columns kept).

        `digest(name, data)` (name as in `tensor_names()`) is given each read's bytes as they
        are read, so calling experts(l, e) for every record in order digests exactly the bytes
        the pack was made from (convert/source.py's TensorDigests).
        """
        rows = self.rows

        def fetch(layer: _Layer, key: tuple[int, str], expert: int) -> npt.NDArray[Any]:
            name = layer.names[key]
            matrix, _ = key
            if rows is not None and matrix < 2 and layer.stacked:
                # gate, up of a tensor share: rows of the intermediate dimension, contiguous
                got = index.read_expert_rows(name, expert, *rows)
            elif layer.stacked:
                got = index.read_expert(name, expert)
            else:
                got = index.read(name.format(e=layer.offset + expert))
            if digest is not None:
                digest(name, np.ascontiguousarray(got).data)
            return got

        def read(
            layer: _Layer, key: tuple[int, str], expert: int, fmt: MatrixFormat
        ) -> npt.NDArray[Any]:
            matrix, role = key
            bits = QUANT_FORMAT_BITS.get(fmt.weight_format, 0)
            if layer.fused is not None:
                # The whole fused slice of this expert (gate and up each read it once).
                name = layer.names[key]
                raw = index.read_expert(name, expert)
                if digest is not None:
                    digest(name, np.ascontiguousarray(raw).data)
                full = _unfuse(raw, layer.fused, matrix, role)
                if rows is None:
                    return full
                r0, r1 = rows  # a tensor-parallel share: gate/up rows, down columns
                if matrix < 2:
                    return np.ascontiguousarray(full[r0:r1])
                return full if role == "bias" else np.ascontiguousarray(full[:, r0:r1])
            if rows is None:
                return fetch(layer, key, expert)
            r0, r1 = rows
            if matrix < 2:  # gate, up: rows of the intermediate dimension
                got = fetch(layer, key, expert)
                return got if layer.stacked else got[r0:r1]
            # down: columns of the intermediate dimension, strided: one pread of the expert.
            full = fetch(layer, key, expert)
            if role == "weight" and bits:
                c0, c1 = r0 * bits // 32, r1 * bits // 32
            elif role in ("scales", "biases"):
                c0, c1 = r0 // fmt.group_size, r1 // fmt.group_size
            else:
                c0, c1 = r0, r1
            return np.ascontiguousarray(full[:, c0:c1])

        def experts(pack_layer: int, expert: int) -> tuple[Any, ...]:
            layer = self.layers[pack_layer]
            formats = self.formats_of(pack_layer)
            out: list[Any] = []
            gated = self.geometry.gated
            for m, fmt in enumerate(formats):
                if m == 0 and not gated:  # gateless experts: no gate (write_pack takes None)
                    out.append(None)
                    continue
                w = read(layer, (m, "weight"), expert, fmt)
                bits = QUANT_FORMAT_BITS.get(fmt.weight_format, 0)
                if bits:
                    mxfp4 = fmt.weight_format == "mxfp4"
                    out.append(
                        QuantizedMatrix(
                            np.ascontiguousarray(w, dtype=np.uint32),
                            read(layer, (m, "scales"), expert, fmt),
                            None if mxfp4 else read(layer, (m, "biases"), expert, fmt),
                            bits,
                            fmt.group_size,
                            mode="mxfp4" if mxfp4 else "affine",
                        )
                    )
                else:
                    # bf16 widens exactly to float32 and the writer rounds it back exactly.
                    out.append(bf16_bits_to_f32(w) if w.dtype == np.uint16 else w)
            if self.bias_dtype is not None:
                out.extend(
                    None
                    if m == 0 and not gated
                    else read(layer, (m, "bias"), expert, formats[m]).reshape(-1)
                    for m in range(3)
                )
            return tuple(out)

        return experts


_SPLITS: dict[tuple[str, bytes], ColumnsSplit | None] = {}


def declared_columns_split(model_dir: Path) -> ColumnsSplit | None:
    """The gate/up split of a fused gate_up_proj [E, H, 2I] as the checkpoint's transformers
    experts module declares it (its is_concatenated, built from config.json on the meta
    device); None where transformers is not importable or cannot build it. Kept per config
    (find_experts runs on every load's source check)."""
    try:
        key = (str(model_dir.resolve()), (model_dir / "config.json").read_bytes())
    except OSError:
        return None
    if key not in _SPLITS:
        try:
            from strata_stream.convert.experts_interface import declared_concatenated
        except ImportError:
            _SPLITS[key] = None
        else:
            concatenated = declared_concatenated(model_dir)
            _SPLITS[key] = (
                None if concatenated is None else "halves" if concatenated else "interleaved"
            )
    return _SPLITS[key]


def find_experts(
    model_dir: Path, index: SafetensorsIndex, *, columns_split: ColumnsSplit | None = None
) -> ExpertLayout:
    """Locate and check the routed experts; raises ConfigError/PackError naming what is wrong.

    `columns_split`: how a fused gate_up_proj [E, H, 2I] holds gate and up, where the caller
    knows (the transformers loader, from the experts module it built); None: read from the
    experts module transformers builds for config.json, else assumed interleaved. The pack's
    model block records the split (layout ``fused_columns`` or ``fused_columns_halves``) and,
    where it was assumed, says so (``columns_split_assumed``)."""
    if columns_split not in (None, "interleaved", "halves"):
        raise ConfigError(f"columns_split must be 'interleaved' or 'halves', got {columns_split!r}")
    config = read_config(model_dir)
    model_type = str(config.get("model_type", "unknown"))
    ungated = next((n for n in index.tensors if _UNGATED.search(n)), None)
    if ungated is not None:
        raise ConfigError(
            f"{model_dir}: {model_type}'s routed experts have one input projection and no gate "
            f"({ungated}: mlx-lm's SwitchMLP); the converter reads mlx-lm's gated experts "
            "(gate, up, down) only, and the mlx-lm front-end computes no gateless activation"
        )
    # By (decoder layer, experts prefix): a decoder layer may hold several experts modules.
    layers: dict[tuple[int, str], _Layer] = {}
    hidden = int(config.get("hidden_size", 0))
    if not hidden:
        raise ConfigError(f"{model_dir}: config.json has no hidden_size")
    for name in index.tensors:
        if _W13_SCALED.search(name):
            raise ConfigError(
                f"{model_dir}: {model_type}'s experts are stored scaled ({name}); only their "
                "float w13_weight/w2_weight are read"
            )
        linear = _FUSED_LINEAR.match(name)
        if linear is not None and len(index.tensors[name].shape) == 2:
            continue  # a dense Linear named so (granitemoehybrid's shared_mlp), not experts
        up = _FUSED_UP.match(name)
        if up is not None and (
            len(index.tensors[name].shape) != 3 or f"{up['prefix']}.gate_proj" in index.tensors
        ):
            up = None  # a dense parameter named so, or gated experts: not gateless experts
        fm = _FUSED.match(name) or linear or _FUSED_FC.match(name) or _FUSED_W13.match(name) or up
        if fm is not None:
            _add_fused(model_dir, index, layers, fm)
            continue
        m = _STACKED.match(name)
        if m is not None and m["module"] == "moe" and len(index.tensors[name].shape) < 3:
            m = None  # a dense MLP under a module named moe; stacked experts are [E, rows, cols]
        stacked = m is not None
        if m is None:
            m = _PER_EXPERT.match(name)
            if m is None:
                continue
        i = int(m["layer"])
        layer = layers.setdefault((i, m["prefix"]), _Layer(i, m["prefix"], stacked))
        if layer.stacked != stacked or layer.fused is not None:
            raise PackError(f"{model_dir}: layer {i} mixes expert tensor layouts")
        key = (_MATRIX[m["mat"]], m["role"])
        if stacked:
            layer.names[key] = name
        else:
            template = f"{m['prefix']}.{{e}}.{m['mat']}.{m['role']}"
            layer.names[key] = template
    widths = {
        _orient_fused(model_dir, index, layer, hidden)
        for layer in layers.values()
        if layer.fused is not None
    }
    if not layers:
        raise ConfigError(f"{model_dir}: {model_type}: no routed expert tensors found")
    if len(widths) > 1:
        raise PackError(f"{model_dir}: the experts of different layers work at widths {widths}")
    # Fused experts may work at a width of their own (muse_spark's moe_hidden_size, between the
    # block's own projections): the pack's hidden size is theirs.
    hidden = widths.pop() if widths else hidden
    columns = [layer for layer in layers.values() if layer.fused == "columns"]
    assumed = False
    if columns:
        split = columns_split or declared_columns_split(model_dir)
        assumed = split is None
        if (split or ASSUMED_COLUMNS_SPLIT) == "halves":
            for layer in columns:
                layer.fused = "columns_halves"
    # Pack layers in the order of (decoder layer, experts prefix): a decoder layer with several
    # experts modules (text and vision experts, say) gives each its own pack layer, in the
    # order of their paths, as the transformers loader orders the modules.
    # Each per-expert template's count, once: every (layer, matrix, role) asks for it, and a
    # count is a scan of every tensor name.
    listed = functools.cache(functools.partial(_listed, index))
    ordered = _split_sets(listed, config, tuple(layers[k] for k in sorted(layers)))

    first = ordered[0]
    roles = {r for (_, r) in first.names}
    # Gateless experts (nemotron_h: up_proj, an activation, down_proj) store up and down only.
    gated = any((0, "weight") in layer.names for layer in ordered)
    if gated and (0, "weight") not in first.names:
        raise PackError(f"{model_dir}: layer {first.decoder_layer} has no gate weight")
    if not gated and (1, "weight") not in first.names:
        raise PackError(f"{model_dir}: layer {first.decoder_layer} has neither gate nor up weight")

    def loc(layer: _Layer, key: tuple[int, str]) -> tuple[str, tuple[int, ...]]:
        name = layer.names[key]
        if layer.fused is not None:
            t = index.tensors[name]
            dtype = "U32" if layer.fused == "blocks" and key[1] == "weight" else t.dtype
            return dtype, _unfused_shape(t.shape, layer.fused, key[0], key[1])
        if layer.stacked:
            t = index.tensors[name]
            return t.dtype, t.shape
        t = index.tensors[name.format(e=layer.offset)]
        return t.dtype, (_set_size(listed, layer, name), *t.shape)

    _, gshape = loc(first, (0 if gated else 1, "weight"))
    n_experts, inter = gshape[0], gshape[1]
    for layer in ordered[1:]:
        key = (0 if gated else 1, "weight")
        if key not in layer.names:
            continue  # said below, by the tensor it lacks
        shape = loc(layer, key)[1]
        if layer.size and (shape[0], shape[1]) != (n_experts, inter):
            # Sets of one list (`_split_sets`): the modules of a decoder layer may differ.
            raise ConfigError(
                f"{model_dir}: decoder layer {layer.decoder_layer}'s experts "
                f"{layer.offset}..{layer.offset + layer.size - 1} of {layer.prefix} are "
                f"{shape[0]} of intermediate width {shape[1]}, the first layer's {n_experts} "
                f"of {inter}: the pack holds experts of one shape (experts modules of "
                "different widths in one model are not supported)"
            )
    # Each matrix of each layer in the format its tensors are stored in: mlx-lm's quantization
    # predicates may give a projection or a layer its own (granitemoe's 8-bit down projection,
    # muse_spark's unquantized first and last layers). One format throughout is a version 2
    # pack; several are a version 3 one (docs/pack-format.md).
    # A gateless layer's (absent) gate is given its up's format.
    per_layer = tuple(
        cast(
            LayerFormat,
            tuple(
                _matrix_format(
                    model_dir, layer, m if gated else max(m, 1), loc, hidden if m < 2 else inter
                )
                for m in range(3)
            ),
        )
        for layer in ordered
    )
    uniform = len(set(per_layer)) == 1 and len(set(per_layer[0])) == 1
    pack_format = per_layer[0][0]
    weight_format, group = pack_format.weight_format, pack_format.group_size
    scale_dtype = pack_format.scale_dtype
    layer_formats = () if uniform else per_layer
    bias_dtype = None
    if "bias" in roles:
        bdtype, _ = loc(first, (0 if gated else 1, "bias"))
        bias_dtype = _FLOAT_FORMATS.get(bdtype)
        if bias_dtype is None:
            raise ConfigError(f"{model_dir}: expert biases of dtype {bdtype} not supported")

    top_k = _top_k(config)
    if not 1 <= top_k <= n_experts:
        raise ConfigError(
            f"{model_dir}: config.json gives no experts per token in 1..{n_experts} (read "
            f"{', '.join(_TOP_K_KEYS)}; got {top_k})"
        )
    activation, alpha, limit = _activation(model_dir, config, model_type, gated)
    geometry = Geometry(
        n_layers=len(ordered),
        n_experts=n_experts,
        top_k=top_k,
        hidden=hidden,
        moe_intermediate=inter,
        routing="external",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        activation=activation,
        act_alpha=alpha,
        act_limit=limit,
        gated=gated,
    )
    # Every layer, every tensor: the pack's tensor table for its formats (pack/header.py's
    # layer_record_layout, the one statement of that rule), each entry one [E, rows, cols]
    # checkpoint tensor ([E, rows] for a Linear bias).
    for layer, formats in zip(ordered, per_layer, strict=True):
        table, _ = layer_record_layout(geometry, formats, bias_dtype)
        for t in table:  # (gateless: no gate entries)
            role = ROLES[t.role]
            key = (t.matrix, role)
            shape = (n_experts, t.cols) if role == "bias" else (n_experts, t.rows, t.cols)
            dt = _to_st(t.dtype)
            if key not in layer.names:
                raise PackError(
                    f"{model_dir}: decoder layer {layer.decoder_layer} lacks the "
                    f"{MATRICES[t.matrix]} {role} tensor"
                )
            got_dt, got_shape = loc(layer, key)
            if got_dt != dt or tuple(got_shape) != shape:
                raise PackError(
                    f"{model_dir}: {layer.names[key]} is {got_dt} {list(got_shape)}, "
                    f"expected {dt} {list(shape)} (the experts of every layer must have "
                    "one shape)"
                )

    model = {
        "model_type": model_type,
        "n_decoder_layers": int(config.get("num_hidden_layers", 0)),
        "decoder_layers": [layer.decoder_layer for layer in ordered],
        "experts_prefixes": [layer.prefix for layer in ordered],
        "expert_offsets": [layer.offset for layer in ordered],
        "first_k_dense_replace": int(config.get("first_k_dense_replace", 0) or 0),
        "decoder_sparse_step": int(config.get("decoder_sparse_step", 1) or 1),
        "layout": (
            f"fused_{first.fused}" if first.fused else "stacked" if first.stacked else "per_expert"
        ),
    }
    if assumed:
        model["columns_split_assumed"] = True
    return ExpertLayout(
        model_type,
        geometry,
        weight_format,
        group,
        scale_dtype,
        bias_dtype,
        ordered,
        model,
        layer_formats=layer_formats,
    )


# config.json's names of the tanh approximation of GELU (transformers' ACT2FN keys).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh")


def _activation(
    model_dir: Path, config: dict[str, Any], model_type: str, gated: bool
) -> tuple[str, float, float]:
    """The pack activation (name, act_alpha, act_limit) config.json names for the routed
    experts. Each front-end checks the model's own activation against the pack's before
    computing anything (mlx_lm/blocks.py cpu_activation, transformers/families.py
    check_activation), so a config that says something else is refused there, by name.

    - gateless experts: relu2 (nemotron_h's mlp_hidden_act; the only gateless kind);
    - gpt-oss's clamped SwiGLU: the families whose config names its alpha (gpt_oss,
      minimax_m3_vl, openai_privacy_filter), or gpt_oss's configs that leave it at its default;
    - the clamps alone around a plain SwiGLU: a swiglu_limit without an alpha (deepseek_v4,
      hy_v4, glm5_next);
    - softcapped SwiGLU: mlp_gate_softcap and mlp_up_softcap (inkling2);
    - GELU (tanh) instead of SiLU: hidden_activation or hidden_act naming it (gemma4);
    - otherwise SwiGLU.
    """
    names = ("mlp_hidden_act", "hidden_activation", "hidden_act")
    act = next((config[k] for k in names if config.get(k)), None)
    if not gated:
        if act not in (None, "relu2"):
            raise ConfigError(
                f"{model_dir}: {model_type}'s routed experts have no gate and activation {act}; "
                "the pack computes gateless experts with relu2 only"
            )
        return "relu2", 0.0, 0.0
    if "swiglu_alpha" in config or model_type == "gpt_oss":
        alpha = float(config.get("swiglu_alpha", _OAI_ALPHA))
        return "swiglu_oai", alpha, float(config.get("swiglu_limit", _OAI_LIMIT))
    if isinstance(config.get("swiglu_limit"), (int, float)):
        return "swiglu_clamp", 0.0, float(config["swiglu_limit"])
    gate_cap, up_cap = config.get("mlp_gate_softcap"), config.get("mlp_up_softcap")
    if isinstance(gate_cap, (int, float)) and isinstance(up_cap, (int, float)):
        return "swiglu_softcap", float(gate_cap), float(up_cap)
    if act in _GELU_TANH:
        return "geglu_tanh", 0.0, 0.0
    return "swiglu", 0.0, 0.0


def converted_activation(model_dir: Path, gated: bool) -> tuple[str, float, float] | None:
    """The activation (name, act_alpha, act_limit) converting `model_dir` writes for experts
    with or without a gate; None where its config.json says none (the converter would refuse).
    A pack converted by an older strata-stream may say another (pack_cache.stale_reason)."""
    try:
        config = read_config(model_dir)
        return _activation(model_dir, config, str(config.get("model_type", "unknown")), gated)
    except ConfigError:
        return None


def _matrix_format(
    model_dir: Path,
    layer: _Layer,
    matrix: int,
    loc: Callable[[_Layer, tuple[int, str]], tuple[str, tuple[int, ...]]],
    width: int,
) -> MatrixFormat:
    """How one matrix of one layer's experts is stored, from its tensors' dtypes and shapes
    (`width`: the matrix's input width, hidden for gate and up, the intermediate for down)."""
    name = f"decoder layer {layer.decoder_layer} expert {MATRICES[matrix]}"
    roles = {r for (m, r) in layer.names if m == matrix}
    if (matrix, "weight") not in layer.names:
        raise PackError(f"{model_dir}: {name} has no weight")
    wdtype, wshape = loc(layer, (matrix, "weight"))
    if "scales" not in roles:
        if wdtype not in _FLOAT_FORMATS:
            raise ConfigError(f"{model_dir}: {name} weights of dtype {wdtype} not supported")
        if wshape[2] != width:
            raise ConfigError(
                f"{model_dir}: {name} weight {list(wshape)} does not have {width} columns"
            )
        return MatrixFormat(_FLOAT_FORMATS[wdtype])
    sdtype, sshape = loc(layer, (matrix, "scales"))
    group = width // sshape[2] if sshape[2] else 0
    if sdtype == "U8" or "biases" not in roles:
        # MLX's microscaling modes: u8 scales, no biases. mxfp4 is 4 bits in groups of 32
        # (gpt-oss); nvfp4 (groups of 16, FP8 scales) and mxfp8 are not taken on.
        if not (sdtype == "U8" and "biases" not in roles and wdtype == "U32"
                and wshape[2] * 8 == width and group == 32):  # fmt: skip
            raise ConfigError(
                f"{model_dir}: {name} is quantized without affine biases (scales {sdtype}, "
                f"groups of {group}) but is not mxfp4: of MLX's microscaling modes only mxfp4 "
                "is supported (nvfp4 and mxfp8 are not)"
            )
        return MatrixFormat("mxfp4", 32, "e8m0")
    bits = wshape[2] * 32 // width
    if wdtype != "U32" or bits not in (4, 8) or wshape[2] * 32 != bits * width:
        raise ConfigError(
            f"{model_dir}: {name} weight {wdtype} {list(wshape)} is not MLX affine q4/q8 of "
            f"width {width}"
        )
    scale_dtype = _FLOAT_FORMATS.get(sdtype)
    if scale_dtype is None or group * sshape[2] != width:
        raise ConfigError(f"{model_dir}: {name} scales {sdtype} {list(sshape)} not understood")
    return MatrixFormat(f"q{bits}", group, scale_dtype)


def share_layout(layout: ExpertLayout, share: Share) -> ExpertLayout:
    """The part of `layout` one rank holds: the MoE layers in its decoder range, renumbered from
    pack layer 0, and its slice of every expert (see share.py). ConfigError when the share holds
    no MoE layer or the slice is not whole quantization groups."""
    if share.whole:
        return layout
    held = [share.holds_layer(layer.decoder_layer) for layer in layout.layers]
    layers = tuple(layer for layer, h in zip(layout.layers, held, strict=True) if h)
    layer_formats = tuple(f for f, h in zip(layout.layer_formats, held, strict=False) if h)
    if not layers:
        raise ConfigError(f"{share.describe()} holds no MoE layer of this {layout.model_type}")
    g = layout.geometry
    rows = None
    inter = g.moe_intermediate
    if share.tp_size > 1:
        if layout.layer_formats:
            raise ConfigError(
                "tensor parallel streaming of experts whose formats differ by layer or matrix "
                "is not supported"
            )
        if layout.bias_dtype is not None:
            raise ConfigError(
                "tensor parallel streaming of experts with Linear biases is not supported "
                "(mlx-lm rescales their down bias per family)"
            )
        quantized = layout.weight_format in ("q4", "q8", "mxfp4")
        rows = share.intermediate_slice(inter, layout.group_size, quantized)
        inter = rows[1] - rows[0]
    geometry = replace(g, n_layers=len(layers), moe_intermediate=inter)
    model = {
        **layout.model,
        "decoder_layers": [layer.decoder_layer for layer in layers],
        "experts_prefixes": [layer.prefix for layer in layers],
        "expert_offsets": [layer.offset for layer in layers],
        "share": share.to_json(),
    }
    return replace(
        layout,
        geometry=geometry,
        layers=layers,
        model=model,
        share=share,
        rows=rows,
        layer_formats=layer_formats,
    )


def _to_st(name: str | None) -> str | None:
    return {"f32": "F32", "f16": "F16", "bf16": "BF16", "u32": "U32", "e8m0": "U8"}.get(name or "")


# The config keys families name the routed experts of one experts module by (an int, or a list
# with one entry per experts module of a decoder layer).
_N_EXPERTS_KEYS = ("num_experts", "moe_num_experts", "num_local_experts", "n_routed_experts")


def _set_sizes(config: dict[str, Any]) -> list[int]:
    """The experts of each experts module of a decoder layer, as config.json says: [E] for an
    int, the list where it gives one per module; [] where it says nothing usable."""
    for key in _N_EXPERTS_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return [value]
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            return list(value)
    return []


def _listed(index: SafetensorsIndex, template: str) -> int:
    """How many experts a per-expert tensor template names in the checkpoint."""
    return sum(1 for n in index.tensors if _per_expert_of(n, template))


def _set_size(listed: Callable[[str], int], layer: _Layer, template: str) -> int:
    """The experts of `layer`'s set in a per-expert list (all of it for a list of one set;
    `listed`: _listed over the checkpoint's index, kept per template by find_experts)."""
    return layer.size if layer.size else listed(template)


def _split_sets(
    listed: Callable[[str], int], config: dict[str, Any], layers: tuple[_Layer, ...]
) -> tuple[_Layer, ...]:
    """Each per-expert list that holds several experts modules' sets, as one pack layer per set.

    A checkpoint may list the experts of several experts modules of one decoder layer as one
    list (ERNIE-4.5-VL's ``mlp.experts.{e}``: its text experts, then its vision experts, which
    transformers' own conversion splits into equal consecutive chunks, one per module). Where
    a list holds a whole multiple k > 1 of the experts config.json gives one module (or the sum
    of the per-module counts it lists), it is k sets of consecutive experts, in order."""
    sizes = _set_sizes(config)
    out: list[_Layer] = []
    for layer in layers:
        if layer.stacked or not sizes:
            out.append(layer)
            continue
        n_listed = listed(next(iter(layer.names.values())))
        if len(sizes) == 1:
            k = n_listed // sizes[0] if n_listed % sizes[0] == 0 else 1
            chunks = [sizes[0]] * k
        else:
            chunks = sizes if sum(sizes) == n_listed else [n_listed]
        if len(chunks) < 2:
            out.append(layer)
            continue
        offset = 0
        for n in chunks:
            out.append(replace(layer, names=dict(layer.names), offset=offset, size=n))
            offset += n
    return tuple(out)


def _per_expert_of(name: str, template: str) -> bool:
    head, _, tail = template.partition("{e}")
    middle = name[len(head) : len(name) - len(tail)] if name.endswith(tail) else ""
    return name.startswith(head) and middle.isdigit()


def _add_fused(
    model_dir: Path,
    index: SafetensorsIndex,
    layers: dict[tuple[int, str], _Layer],
    m: re.Match[str],
) -> None:
    """Records one fused tensor (``experts.gate_up_proj``, ``.down_proj``, their ``_bias``;
    granitemoe's ``input_linear``/``output_linear``) under the pack's (matrix, role) keys; the
    layer's orientation is read from the shapes once all are found (_orient_fused)."""
    i = int(m["layer"])
    name = m.group(0)
    t = index.tensors[name]
    layer = layers.setdefault((i, m["prefix"]), _Layer(i, m["prefix"], True, fused="unknown"))
    if layer.fused is None:
        raise PackError(f"{model_dir}: layer {i} mixes expert tensor layouts")
    suffix = m.groupdict().get("suffix")
    role = {None: "weight", "_bias": "bias", "_blocks": "weight", "_scales": "scales"}[suffix]
    want_dims = {"weight": 4 if suffix == "_blocks" else 3, "scales": 3, "bias": 2}[role]
    if len(t.shape) != want_dims:
        raise PackError(f"{model_dir}: {name} is {list(t.shape)}, not {want_dims}-D")
    if suffix == "_blocks":
        layer.fused = "blocks"
    elif m["mat"] in ("fc1", "fc2"):
        layer.fused = "halves"  # gate and up concatenated, whichever axis they are on
    elif m["mat"] in ("w13", "w2"):
        layer.fused = "interleaved"  # gate and up rows alternate
    elif m["mat"] == "up_proj" or (m["mat"] == "down_proj" and layer.fused == "gateless"):
        layer.fused = "gateless"
    mat = _FUSED_NAMES.get(m["mat"], m["mat"])
    matrices = {"gate_up_proj": (0, 1), "up_proj": (1,)}.get(mat, (2,))
    for matrix in matrices:
        layer.names[(matrix, role)] = name


def _fused_shapes(
    model_dir: Path, index: SafetensorsIndex, layer: _Layer, first: int, names: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a fused layer's `first` weight (0 gate_up, 1 up) and of its down weight;
    PackError naming `names` where the layer lacks either."""
    try:
        return (
            index.tensors[layer.names[(first, "weight")]].shape,
            index.tensors[layer.names[(2, "weight")]].shape,
        )
    except KeyError:
        raise PackError(f"{model_dir}: decoder layer {layer.decoder_layer} lacks {names}") from None


def _orient_fused(model_dir: Path, index: SafetensorsIndex, layer: _Layer, hidden: int) -> int:
    """Which orientation a fused layer has, from where hidden_size sits in both tensors:
    gate_up [E, 2I, H] with down [E, H, I] ("rows"), or gpt-oss's gate_up [E, H, 2I] with
    down [E, I, H] ("columns"). The two cannot both fit one pair of shapes, so where
    hidden_size fits neither, the shapes alone decide: experts of a width of their own. Gateless
    pairs (up [E, I, H] with down [E, H, I], or the other way round) need hidden_size. Returns
    the experts' width."""
    if layer.fused == "gateless":
        return _orient_gateless(model_dir, index, layer, hidden)
    gate_up, down = _fused_shapes(
        model_dir, index, layer, 0, "experts.gate_up_proj or experts.down_proj"
    )
    if layer.fused == "blocks":  # [E, 2I, H/32, 16] and [E, H, I/32, 16]
        if not (gate_up[2] * 32 == hidden and down[1] == hidden and gate_up[1] == 2 * down[2] * 32
                and gate_up[3] == down[3] == 16):  # fmt: skip
            raise PackError(
                f"{model_dir}: mxfp4 experts gate_up_proj_blocks {list(gate_up)} and "
                f"down_proj_blocks {list(down)} are not [E, 2I, {hidden // 32}, 16] and "
                f"[E, {hidden}, I/32, 16]"
            )
        return hidden
    _, a, b = gate_up
    _, c, d = down
    if not (b == hidden and c == hidden) and not (a == hidden and d == hidden):
        if b == c and a == 2 * d:
            hidden = b
        elif a == d and b == 2 * c:
            hidden = a
    if b == hidden and c == hidden and a == 2 * d:
        layer.fused = "rows_interleaved" if layer.fused == "interleaved" else "rows"
    elif layer.fused == "interleaved":
        raise PackError(
            f"{model_dir}: experts w13_weight [E, {a}, {b}] and w2_weight [E, {c}, {d}] are not "
            f"[E, 2I, {hidden}] and [E, {hidden}, I]"
        )
    elif a == hidden and d == hidden and b == 2 * c:
        layer.fused = "columns_halves" if layer.fused == "halves" else "columns"
    else:
        raise PackError(
            f"{model_dir}: fused experts gate_up_proj [E, {a}, {b}] and down_proj [E, {c}, {d}] "
            f"fit neither [E, 2I, {hidden}] / [E, {hidden}, I] nor [E, {hidden}, 2I] / "
            f"[E, I, {hidden}]"
        )
    return hidden


def _orient_gateless(model_dir: Path, index: SafetensorsIndex, layer: _Layer, hidden: int) -> int:
    """A gateless fused pair: up [E, I, H] with down [E, H, I] ("up_rows") or up [E, H, I] with
    down [E, I, H] ("up_columns", ergo's); where I == H the Linear orientation ("up_rows")."""
    up, down = _fused_shapes(model_dir, index, layer, 1, "up_proj or down_proj")
    _, a, b = up
    _, c, d = down
    if b == hidden and c == hidden and a == d:
        layer.fused = "up_rows"
    elif a == hidden and d == hidden and b == c:
        layer.fused = "up_columns"
    else:
        raise PackError(
            f"{model_dir}: gateless experts up_proj [E, {a}, {b}] and down_proj [E, {c}, {d}] "
            f"fit neither [E, I, {hidden}] / [E, {hidden}, I] nor [E, {hidden}, I] / "
            f"[E, I, {hidden}]"
        )
    return hidden


def _unfused_shape(shape: tuple[int, ...], fused: str, matrix: int, role: str) -> tuple[int, ...]:
    """The [E, rows, cols] (or [E, rows] for a bias) a fused tensor gives one matrix (mxfp4
    blocks as the uint32 words they are)."""
    if role == "bias":
        return (shape[0], shape[1] // 2) if matrix < 2 else tuple(shape)
    if fused == "blocks":
        e, r, g = shape[:3]
        cols = g * 4 if role == "weight" else g  # 16 bytes a block are 4 words
        return (e, r // 2 if matrix < 2 else r, cols)
    e, a, b = shape
    if fused.startswith("up_"):  # gateless: up and down whole
        return (e, a, b) if fused == "up_rows" else (e, b, a)
    if matrix < 2:
        return (e, a // 2, b) if fused.startswith("rows") else (e, b // 2, a)
    return (e, a, b) if fused.startswith("rows") else (e, b, a)


def _unfuse(t: npt.NDArray[Any], fused: str, matrix: int, role: str) -> npt.NDArray[Any]:
    """One matrix (or bias) of one expert from its slice of a fused tensor."""
    if fused == "blocks" and role != "bias":
        rows = t if matrix == 2 else t[matrix::2]  # gate and up rows interleave
        if role == "weight":  # [R, H/32, 16] bytes -> [R, H/8] little-endian words
            return np.ascontiguousarray(rows).reshape(rows.shape[0], -1).view("<u4")
        return np.ascontiguousarray(rows)
    if role == "bias":
        if matrix == 2:
            return t
        if fused in ("rows", "columns_halves"):
            half = t.shape[0] // 2
            return np.ascontiguousarray(t[:half] if matrix == 0 else t[half:])
        return np.ascontiguousarray(t[matrix::2])
    if fused.startswith("up_"):  # gateless: up and down whole
        return t if fused == "up_rows" else np.ascontiguousarray(t.T)
    if matrix == 2:
        return t if fused.startswith("rows") else np.ascontiguousarray(t.T)
    if fused == "rows_interleaved":
        return np.ascontiguousarray(t[matrix::2])
    if fused == "rows":
        half = t.shape[0] // 2
        return np.ascontiguousarray(t[:half] if matrix == 0 else t[half:])
    if fused == "columns_halves":
        half = t.shape[1] // 2
        return np.ascontiguousarray((t[:, :half] if matrix == 0 else t[:, half:]).T)
    return np.ascontiguousarray(t[:, matrix::2].T)
