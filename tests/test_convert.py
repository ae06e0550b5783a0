"""strata-stream convert: experts copied byte for byte, one pread per tensor, bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from strata_stream.cli import main
from strata_stream.convert import convert, inspect_checkpoint
from strata_stream.convert.safetensors_index import SafetensorsIndex
from strata_stream.errors import ConfigError, PackError
from strata_stream.mlx_lm.loader import arena_size
from strata_stream.pack import ExpertPack


def _synthetic(path: Path, n_layers: int = 2, e: int = 8, h: int = 128, i: int = 64,
               mode: str = "affine", dense_first: int = 0, bits: int = 4, group: int = 64,
               scale_dtype: type = np.float16, seed: int = 0) -> Path:  # fmt: skip
    """A stacked mlx-lm-style affine checkpoint written with numpy (q4 g64 f16 by default)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(dense_first, dense_first + n_layers):
        p = f"model.layers.{layer}.mlp.switch_mlp"
        for name, (rows, cols) in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                   ("down_proj", (h, i))):  # fmt: skip
            tensors[f"{p}.{name}.weight"] = rng.integers(
                0, 2**32, (e, rows, cols * bits // 32), dtype=np.uint32
            )
            if mode == "affine":
                for role in ("scales", "biases"):
                    tensors[f"{p}.{name}.{role}"] = rng.standard_normal(
                        (e, rows, cols // group)
                    ).astype(scale_dtype)
            else:  # MLX's microscaling modes: u8 scales, no biases
                tensors[f"{p}.{name}.scales"] = rng.integers(
                    0, 255, (e, rows, cols // group), dtype=np.uint8
                )
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = rng.standard_normal((e, h)).astype(
            np.float16
        )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"model_type": "qwen3_moe", "hidden_size": h, "num_experts_per_tok": 2,
              "num_hidden_layers": n_layers + dense_first, "norm_topk_prob": True}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_records_are_the_checkpoints_bytes(tmp_path: Path) -> None:
    ckpt = _synthetic(tmp_path / "m", dense_first=1)
    out = convert(ckpt, tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack, SafetensorsIndex(ckpt) as index:
        g = pack.geometry
        dims = (g.n_layers, g.n_experts, g.top_k, g.hidden, g.moe_intermediate)
        assert dims == (2, 8, 2, 128, 64)
        assert g.routing == "external" and pack.weight_format == "q4"
        assert pack.group_size == 64 and pack.scale_dtype == "f16"
        assert pack.metadata["model"]["decoder_layers"] == [1, 2]
        assert pack.verify(progress=False) == 16
        for layer, decoder in enumerate((1, 2)):
            for e in range(8):
                mats = pack.stored_weights(layer, e)
                for m, name in enumerate(("gate_proj", "up_proj", "down_proj")):
                    base = f"model.layers.{decoder}.mlp.switch_mlp.{name}"
                    qm = mats[m]
                    for role in ("weight", "scales", "biases"):
                        got = getattr(qm, role).tobytes()
                        assert got == index.read_expert(f"{base}.{role}", e).tobytes()


@pytest.mark.parametrize(
    ("bits", "group", "scale_dtype", "name"),
    [(8, 32, np.float32, "f32"), (4, 128, np.float16, "f16"), (8, 64, np.float16, "f16")],
)
def test_every_affine_format_is_copied(
    tmp_path: Path, bits: int, group: int, scale_dtype: type, name: str
) -> None:
    ckpt = _synthetic(
        tmp_path / "m", i=max(64, group), bits=bits, group=group, scale_dtype=scale_dtype
    )
    out = convert(ckpt, tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack, SafetensorsIndex(ckpt) as index:
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == (f"q{bits}", group, name)
        for e in (0, 7):
            qm = pack.stored_weights(1, e)[2]
            for role in ("weight", "scales", "biases"):
                want = index.read_expert(f"model.layers.1.mlp.switch_mlp.down_proj.{role}", e)
                assert getattr(qm, role).tobytes() == want.tobytes()


def test_peak_memory_is_a_few_records(tmp_path: Path) -> None:
    ckpt = _synthetic(tmp_path / "m", n_layers=4, e=32, h=512, i=256)
    experts_bytes = sum(t.nbytes for t in SafetensorsIndex(ckpt).tensors.values())
    tracemalloc.start()
    try:
        convert(ckpt, tmp_path / "m.strpk", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with ExpertPack.open(tmp_path / "m.strpk") as pack:
        record = pack.record_stride
    assert experts_bytes > 20 << 20
    assert peak < 8 * record + (1 << 20), (peak, record, experts_bytes)


def test_per_expert_layout_packs_the_same_records(tmp_path: Path) -> None:
    stacked = _synthetic(tmp_path / "stacked")
    per = tmp_path / "per"
    per.mkdir()
    with SafetensorsIndex(stacked) as index:
        tensors = {}
        for name in index.tensors:
            if ".switch_mlp." not in name:
                tensors[name] = np.array(index.read(name))
                continue
            head, _, tail = name.partition(".switch_mlp.")
            mat, role = tail.split(".")
            hf = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[mat]  # Mixtral names
            for e in range(index.tensors[name].shape[0]):
                tensors[f"{head}.experts.{e}.{hf}.{role}"] = np.array(index.read_expert(name, e))
    save_file(tensors, str(per / "model.safetensors"))
    (per / "config.json").write_text((stacked / "config.json").read_text())
    a = convert(stacked, tmp_path / "a.strpk", progress=False)
    b = convert(per, tmp_path / "b.strpk", progress=False)
    with ExpertPack.open(a) as pa, ExpertPack.open(b) as pb:
        assert pb.metadata["model"]["layout"] == "per_expert"
        for layer in range(2):
            for e in range(8):
                assert pa.read_record(layer, e) == pb.read_record(layer, e)


def test_mxfp4_experts_are_copied(tmp_path: Path) -> None:
    ckpt = _synthetic(tmp_path / "m", mode="mxfp4", group=32)
    out = convert(ckpt, tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack, SafetensorsIndex(ckpt) as index:
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == ("mxfp4", 32, "e8m0")
        assert [t.name for t in pack.tensors[:2]] == ["gate.weight", "gate.scales"]
        assert pack.verify(progress=False) == 16
        for e in (0, 7):
            qm = pack.stored_weights(1, e)[2]
            assert qm.mode == "mxfp4" and qm.biases is None
            for role in ("weight", "scales"):
                want = index.read_expert(f"model.layers.1.mlp.switch_mlp.down_proj.{role}", e)
                assert getattr(qm, role).tobytes() == want.tobytes()


def test_unsupported_checkpoints_are_refused_clearly(tmp_path: Path) -> None:
    for mode, bits, group in (("nvfp4", 4, 16), ("mxfp8", 8, 32)):
        ckpt = _synthetic(tmp_path / mode, mode=mode, bits=bits, group=group)
        with pytest.raises(ConfigError, match="only mxfp4 is supported"):
            convert(ckpt, tmp_path / "x.strpk", progress=False)
    empty = tmp_path / "dense"
    empty.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float32)},
              str(empty / "model.safetensors"))  # fmt: skip
    (empty / "config.json").write_text('{"model_type": "llama", "hidden_size": 4}')
    with pytest.raises(ConfigError, match="no routed expert tensors"):
        convert(empty, tmp_path / "y.strpk", progress=False)
    no_config = tmp_path / "noconfig"
    no_config.mkdir()
    save_file({"a": np.zeros(1, np.float32)}, str(no_config / "m.safetensors"))
    with pytest.raises(ConfigError, match="no config.json"):
        inspect_checkpoint(no_config)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(PackError, match="safetensors header length"):
        SafetensorsIndex(bad)
    assert not (tmp_path / "x.strpk").exists() and not (tmp_path / "y.strpk").exists()


def test_cli_convert_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _synthetic(tmp_path / "m")
    out = tmp_path / "m.strpk"
    assert main(["convert", str(ckpt), "-o", str(out), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "routing        external" in text and "decoder layers [0, 1]" in text
    assert main(["convert", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "missing: no such model directory" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert main(["convert", str(bare), "-o", str(out)]) == 2
    assert "bare: no .safetensors files" in capsys.readouterr().err


def test_arena_is_sized_from_available_memory(tmp_path: Path) -> None:
    out = convert(_synthetic(tmp_path / "m"), tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack:
        stride, total = pack.record_stride, pack.geometry.n_records * pack.record_stride
        minimum = 4 * stride
        assert arena_size(pack, None, available=64 << 30) == total  # everything fits
        assert arena_size(pack, 10 * stride) == 10 * stride  # explicit wins
        assert arena_size(pack, 10 * total) == total
        with pytest.raises(ConfigError, match=f"below the minimum {minimum} bytes"):
            arena_size(pack, minimum - 1)
        with pytest.raises(ConfigError, match="not enough memory for the experts.*in all"):
            arena_size(pack, None, available=1 << 20)


def test_experts_without_a_gate_are_refused_naming_why(tmp_path: Path) -> None:
    """mlx-lm's SwitchMLP experts (fc1, activation, fc2: phixtral, nemotron_h) have no gate:
    convert says so in one line instead of failing on the config or finding no experts."""
    from safetensors.numpy import save_file

    from strata_stream.convert import convert
    from strata_stream.errors import ConfigError

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "phixtral", "model_dim": 64}')
    save_file(
        {"transformer.h.0.moe.switch_mlp.fc1.weight": np.zeros((4, 32, 64), np.float32),
         "transformer.h.0.moe.switch_mlp.fc2.weight": np.zeros((4, 64, 32), np.float32)},
        str(model / "model.safetensors"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="phixtral's routed experts have one input projection"):
        convert(model, tmp_path / "m.strpk", progress=False)
