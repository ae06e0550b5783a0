"""strata-stream convert on the layouts transformers 5 writes, and --quantize q4|q8.

- fused experts: ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (transformers 5's
  experts modules) and gpt-oss's ``[E, H, 2I]`` (interleaved gate/up columns) / ``[E, I, H]``
  with biases: every record is the checkpoint's own matrix, sliced and transposed;
- --quantize: lossy by design, so it is tested against the dequantized reference: the pack's
  weights are MLX's affine quantization of the checkpoint's (error within half a step per
  group), and a transformers model given those dequantized weights computes the logits the
  streamed model does (float32 accumulation order apart).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from strata_stream.cli import main
from strata_stream.convert import convert
from strata_stream.errors import ConfigError
from strata_stream.pack import ExpertPack
from strata_stream.pack.quant import dequantize, quantize

E, H, INTER = 4, 128, 64


def _fused(path: Path, orientation: str, biases: bool) -> dict[str, np.ndarray]:
    """A two-layer checkpoint with fused experts in `orientation` ("rows" or "columns")."""
    rng = np.random.default_rng(1)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        if orientation == "rows":
            tensors[f"{p}.gate_up_proj"] = rng.standard_normal((E, 2 * INTER, H), np.float32)
            tensors[f"{p}.down_proj"] = rng.standard_normal((E, H, INTER), np.float32)
        else:
            tensors[f"{p}.gate_up_proj"] = rng.standard_normal((E, H, 2 * INTER), np.float32)
            tensors[f"{p}.down_proj"] = rng.standard_normal((E, INTER, H), np.float32)
        if biases:
            tensors[f"{p}.gate_up_proj_bias"] = rng.standard_normal((E, 2 * INTER), np.float32)
            tensors[f"{p}.down_proj_bias"] = rng.standard_normal((E, H), np.float32)
        tensors[f"model.layers.{layer}.mlp.router.weight"] = rng.standard_normal((E, H), np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    model_type = "gpt_oss" if orientation == "columns" else "qwen3_moe"
    config = {"model_type": model_type, "hidden_size": H, "num_experts_per_tok": 2,
              "num_hidden_layers": 2}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize(("orientation", "biases"), [("rows", False), ("columns", True)])
def test_fused_layouts_unfuse_into_the_checkpoints_matrices(
    tmp_path: Path, orientation: str, biases: bool
) -> None:
    tensors = _fused(tmp_path / "m", orientation, biases)
    out = convert(tmp_path / "m", tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack:
        g = pack.geometry
        assert (g.n_layers, g.n_experts, g.hidden, g.moe_intermediate) == (2, E, H, INTER)
        assert pack.metadata["model"]["layout"] == f"fused_{orientation}"
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            for e in range(E):
                gu, down = tensors[f"{p}.gate_up_proj"][e], tensors[f"{p}.down_proj"][e]
                if orientation == "rows":  # [2I, H]: gate rows then up rows; down [H, I]
                    want = (gu[:INTER], gu[INTER:], down)
                else:  # [H, 2I]: interleaved columns; down [I, H]
                    want = (gu[:, 0::2].T, gu[:, 1::2].T, down.T)
                got = pack.expert_weights(layer, e)
                for w, gmat in zip(want, got, strict=True):
                    assert np.array_equal(gmat, w)
                if biases:
                    b = tensors[f"{p}.gate_up_proj_bias"][e]
                    want_b = (b[0::2], b[1::2], tensors[f"{p}.down_proj_bias"][e])
                    for w, gb in zip(want_b, pack.expert_biases(layer, e), strict=True):
                        assert np.array_equal(gb.reshape(-1), w)


def _converted_under_other_names(
    tmp_path: Path, orientation: str, gate_up: str, down: str
) -> tuple[Any, Path]:
    """_fused's checkpoint with its fused pair renamed as another family writes it
    (`gate_up`, `down`: the names replacing ``mlp.experts.gate_up_proj`` / ``.down_proj``),
    and the pack convert makes of it: (gate_up [layer][e], down [layer][e]), pack."""
    tensors = _fused(tmp_path / "m", orientation, False)
    renamed = {
        k.replace("mlp.experts.gate_up_proj", gate_up).replace("mlp.experts.down_proj", down): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(tmp_path / "m" / "model.safetensors"))
    fused = [
        (renamed[f"model.layers.{layer}.{gate_up}"], renamed[f"model.layers.{layer}.{down}"])
        for layer in range(2)
    ]
    return fused, convert(tmp_path / "m", tmp_path / "m.strpk", progress=False)


def _check_unfused(pack_path: Path, layout: str, fused: Any, split: Any) -> None:
    with ExpertPack.open(pack_path) as pack:
        assert pack.metadata["model"]["layout"] == layout
        for layer, (gu, down) in enumerate(fused):
            for e in range(E):
                for w, got in zip(split(gu[e], down[e]), pack.expert_weights(layer, e),
                                  strict=True):  # fmt: skip
                    assert np.array_equal(got, w)


def test_granitemoes_input_and_output_linear_are_the_fused_rows_layout(tmp_path: Path) -> None:
    # granitemoe's checkpoints name the fused pair as Linear-style parameters of the block:
    # input_linear [E, 2I, H] (gate rows, then up rows) and output_linear [E, H, I].
    fused, out = _converted_under_other_names(
        tmp_path, "rows", "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.output_linear.weight",
    )  # fmt: skip
    _check_unfused(out, "fused_rows", fused, lambda gu, d: (gu[:INTER], gu[INTER:], d))


def test_arias_fc1_is_gate_columns_then_up_columns(tmp_path: Path) -> None:
    # aria's experts.fc1 [E, H, 2I] holds gate then up as concatenated column halves (not
    # gpt-oss's interleaving), experts.fc2 [E, I, H] the down projection.
    fused, out = _converted_under_other_names(
        tmp_path, "columns", "mlp.experts.fc1.weight", "mlp.experts.fc2.weight"
    )
    _check_unfused(
        out, "fused_columns_halves", fused, lambda gu, d: (gu[:, :INTER].T, gu[:, INTER:].T, d.T)
    )


def test_a_config_naming_swiglu_alpha_packs_gpt_osss_activation(tmp_path: Path) -> None:
    # minimax_m3_vl, openai_privacy_filter: gpt-oss's clamped SwiGLU outside gpt_oss, its
    # constants from the config (each front-end checks the model's own function against it).
    _fused(tmp_path / "m", "rows", False)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="minimax_m3_vl_text", swiglu_alpha=1.5, swiglu_limit=6.0)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    out = convert(tmp_path / "m", tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack:
        g = pack.geometry
        assert (g.activation, g.act_alpha, g.act_limit) == ("swiglu_oai", 1.5, 6.0)


@pytest.mark.parametrize(("fmt", "group"), [("q4", 64), ("q8", 32)])
def test_quantize_is_the_affine_quantization_of_each_expert(
    tmp_path: Path, fmt: str, group: int
) -> None:
    tensors = _fused(tmp_path / "m", "rows", False)
    out = convert(tmp_path / "m", tmp_path / "q.strpk", progress=False, quantize=fmt,
                  group_size=group)  # fmt: skip
    bits = int(fmt[1:])
    with ExpertPack.open(out) as pack:
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == (fmt, group, "f32")
        for layer in range(2):
            gu = tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            down = tensors[f"model.layers.{layer}.mlp.experts.down_proj"]
            for e in range(E):
                for w, got in zip((gu[e][:INTER], gu[e][INTER:], down[e]),
                                  pack.expert_weights(layer, e), strict=True):  # fmt: skip
                    qm = quantize(w, group, bits, "f32")
                    assert np.array_equal(got, dequantize(qm))
                    # Lossy: within one step of its group (MLX's scheme makes the larger edge
                    # exact, so the far edge may round a whole step off).
                    err = np.abs(got - w).reshape(w.shape[0], -1, group).max(-1)
                    assert err.max() > 0 and (err <= np.abs(qm.scales) * (1 + 1e-6)).all()


def test_quantize_refuses_what_it_cannot_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fused(tmp_path / "m", "rows", False)
    with pytest.raises(ConfigError, match="quantize must be one of q4, q8"):
        convert(tmp_path / "m", tmp_path / "x.strpk", quantize="q3")
    with pytest.raises(ConfigError, match="not a multiple of the group size 128"):
        convert(tmp_path / "m", tmp_path / "x.strpk", quantize="q4", group_size=128)
    # The CLI: --quantize writes the pack; a mistake is one line and exit 2.
    args = ["convert", str(tmp_path / "m"), "-o", str(tmp_path / "c.strpk"), "--quiet",
            "--quantize", "q8", "--group-size", "32"]  # fmt: skip
    assert main(args) == 0
    with ExpertPack.open(tmp_path / "c.strpk") as pack:
        assert (pack.weight_format, pack.group_size) == ("q8", 32)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m"), "-o", str(tmp_path / "d.strpk"),
                 "--quantize", "q4", "--group-size", "128"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "group size 128" in err and len(err.splitlines()) == 1


def test_quantized_stream_is_the_dequantized_model(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from strata_stream import StreamConfig
    from strata_stream.transformers import load
    from strata_stream.transformers.random_model import make_checkpoint

    path = make_checkpoint("qwen3_moe", tmp_path / "m", dtype="bfloat16")
    pack = convert(path, tmp_path / "q.strpk", progress=False, quantize="q4", group_size=32)
    model = load(path, pack_path=pack, arena_bytes=1 << 24, dtype=torch.float32,
                 config=StreamConfig(io_threads=2, direct_io=False, persist_profile=False),
                 attn_implementation="eager", progress=False)  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    # The reference: plain transformers with every expert replaced by the pack's dequantized
    # weights (the numbers the quantized pack stands for).
    with ExpertPack.open(pack) as p, torch.no_grad():
        assert p.weight_format == "q4"
        moe = [layer.mlp for layer in ref.model.layers]
        for i, block in enumerate(moe):
            for e in range(p.geometry.n_experts):
                gate, up, down = (torch.from_numpy(w) for w in p.expert_weights(i, e))
                block.experts.gate_up_proj[e] = torch.cat([gate, up])
                block.experts.down_proj[e] = down
    tokens = torch.tensor([[5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2]])
    with torch.no_grad():
        want = ref(tokens).logits[0].numpy()
        got = model(tokens).logits[0].numpy()
    model.strata_engine.close()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _published_mxfp4(src: Path, dst: Path) -> dict[tuple[int, int], tuple[Any, ...]]:
    """gpt-oss as OpenAI publishes it, from a float checkpoint: the experts as mxfp4
    ``*_blocks`` / ``*_scales`` (gate and up rows interleaved), everything else as it was.
    Returns the quantized (gate, up, down) per (layer, expert)."""
    import shutil

    from safetensors.numpy import load_file

    from strata_stream.pack.quant import quantize_mxfp4

    shutil.copytree(src, dst)
    shard = dst / "model.safetensors"
    tensors = load_file(str(shard))
    config = json.loads((dst / "config.json").read_text())
    quantized: dict[tuple[int, int], tuple[Any, ...]] = {}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        gu, down = tensors.pop(f"{p}.gate_up_proj"), tensors.pop(f"{p}.down_proj")
        n, hidden, inter2 = gu.shape
        blocks: dict[str, list[Any]] = {k: [] for k in ("gu_b", "gu_s", "d_b", "d_s")}
        for e in range(n):
            qs = tuple(quantize_mxfp4(np.ascontiguousarray(m)) for m in
                       (gu[e][:, 0::2].T, gu[e][:, 1::2].T, down[e].T))  # fmt: skip
            quantized[(layer, e)] = qs
            rows_b = np.empty((inter2, hidden // 32, 16), np.uint8)
            rows_s = np.empty((inter2, hidden // 32), np.uint8)
            for m in (0, 1):
                rows_b[m::2] = qs[m].weight.view(np.uint8).reshape(inter2 // 2, -1, 16)
                rows_s[m::2] = qs[m].scales
            blocks["gu_b"].append(rows_b)
            blocks["gu_s"].append(rows_s)
            blocks["d_b"].append(qs[2].weight.view(np.uint8).reshape(hidden, -1, 16))
            blocks["d_s"].append(qs[2].scales)
        tensors[f"{p}.gate_up_proj_blocks"] = np.stack(blocks["gu_b"])
        tensors[f"{p}.gate_up_proj_scales"] = np.stack(blocks["gu_s"])
        tensors[f"{p}.down_proj_blocks"] = np.stack(blocks["d_b"])
        tensors[f"{p}.down_proj_scales"] = np.stack(blocks["d_s"])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return quantized


def test_gpt_oss_published_mxfp4_is_copied_and_streams(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from strata_stream import StreamConfig
    from strata_stream.transformers import load
    from strata_stream.transformers.random_model import make_checkpoint

    src = make_checkpoint("gpt_oss", tmp_path / "f32")
    quantized = _published_mxfp4(src, tmp_path / "mxfp4")
    pack = convert(tmp_path / "mxfp4", tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        assert (p.weight_format, p.scale_dtype, p.bias_dtype) == ("mxfp4", "e8m0", "f32")
        for (layer, e), qs in quantized.items():  # copied: the codes and scales as they were
            for got, qm in zip(p.expert_weights(layer, e), qs, strict=True):
                assert np.array_equal(got, dequantize(qm))
    # Plain transformers dequantizing the experts on load is the oracle.
    mx4 = transformers.Mxfp4Config(dequantize=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32, quantization_config=mx4,
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    ref = ref.float()  # transformers 5.17 dequantizes to bf16 whatever dtype says (exact in f32)
    model = load(tmp_path / "mxfp4", pack_path=pack, arena_bytes=1 << 24, dtype=torch.float32,
                 config=StreamConfig(io_threads=2, direct_io=False, persist_profile=False),
                 attn_implementation="eager", progress=False)  # fmt: skip
    tokens = torch.tensor([[5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2]])
    with torch.no_grad():
        want = ref(tokens).logits[0].numpy()
        got = model(tokens).logits[0].numpy()
    model.strata_engine.close()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_inklings_w13_weight_is_gate_and_up_rows_interleaved(tmp_path: Path) -> None:
    # inkling's checkpoints: experts.w13_weight [E, 2I, H] with gate and up rows alternating
    # (transformers' conversion mapping de-interleaves them, Interleave(dim=1), into
    # gate_up_proj) and experts.w2_weight [E, H, I] for down.
    fused, out = _converted_under_other_names(
        tmp_path, "rows", "mlp.experts.w13_weight", "mlp.experts.w2_weight"
    )
    _check_unfused(out, "fused_rows_interleaved", fused, lambda gu, d: (gu[0::2], gu[1::2], d))


def test_inklings_scaled_experts_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    # An fp8 inkling checkpoint's per-expert scales are not applied: refused, not ignored.
    _converted_under_other_names(
        tmp_path, "rows", "mlp.experts.w13_weight", "mlp.experts.w2_weight"
    )
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.experts.w13_weight_scale"] = np.ones((E, 2 * INTER), np.float32)
    save_file(tensors, str(path))
    with pytest.raises(ConfigError, match="w13_weight_scale"):
        convert(tmp_path / "m", tmp_path / "m2.strpk", progress=False)


def test_step3p7s_moe_module_holds_stacked_experts(tmp_path: Path) -> None:
    # step3p7's checkpoints: moe.{gate,up}_proj.weight [E, I, H] and moe.down_proj.weight
    # [E, H, I], next to dense layers' 2-D mlp.*_proj and a 2-D moe-named dense MLP.
    rng = np.random.default_rng(2)
    tensors: dict[str, np.ndarray] = {
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((INTER, H), np.float32),
        "model.layers.0.moe.up_proj.weight": rng.standard_normal((INTER, H), np.float32),
    }
    for layer in (1, 2):
        p = f"model.layers.{layer}.moe"
        tensors[f"{p}.gate_proj.weight"] = rng.standard_normal((E, INTER, H), np.float32)
        tensors[f"{p}.up_proj.weight"] = rng.standard_normal((E, INTER, H), np.float32)
        tensors[f"{p}.down_proj.weight"] = rng.standard_normal((E, H, INTER), np.float32)
        tensors[f"{p}.gate.weight"] = rng.standard_normal((E, H), np.float32)
    (tmp_path / "m").mkdir()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    config = {"model_type": "step3p7", "text_config": {"hidden_size": H,
              "num_experts_per_tok": 2, "num_hidden_layers": 3}}  # fmt: skip
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    out = convert(tmp_path / "m", tmp_path / "m.strpk", progress=False)
    with ExpertPack.open(out) as pack:
        assert pack.metadata["model"]["decoder_layers"] == [1, 2]
        for pack_layer, layer in enumerate((1, 2)):
            p = f"model.layers.{layer}.moe"
            for e in range(E):
                want = [tensors[f"{p}.{m}_proj.weight"][e] for m in ("gate", "up", "down")]
                for w, got in zip(want, pack.expert_weights(pack_layer, e), strict=True):
                    assert np.array_equal(got, w)


def test_a_2d_input_linear_is_a_dense_mlp_not_experts(tmp_path: Path) -> None:
    # granitemoehybrid: shared_mlp.input_linear.weight [2I', H] and output_linear [H, I'] are
    # the shared expert's dense Linears beside the routed block_sparse_moe.input_linear.
    fused, _ = _converted_under_other_names(
        tmp_path, "rows", "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.output_linear.weight",
    )  # fmt: skip
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    rng = np.random.default_rng(3)
    for layer in range(2):
        p = f"model.layers.{layer}.shared_mlp"
        tensors[f"{p}.input_linear.weight"] = rng.standard_normal((2 * 96, H), np.float32)
        tensors[f"{p}.output_linear.weight"] = rng.standard_normal((H, 96), np.float32)
    save_file(tensors, str(path))
    out = convert(tmp_path / "m", tmp_path / "m2.strpk", progress=False)
    _check_unfused(out, "fused_rows", fused, lambda gu, d: (gu[:INTER], gu[INTER:], d))
