"""Hugging Face transformers models through strata_stream.transformers, one tiny random
checkpoint per family (transformers' own config and model classes, save_pretrained).

Against plain `AutoModelForCausalLM.from_pretrained` on the same directory (eager attention and
eager experts: the oracle):
- float32: teacher-forced logits within 1e-5 of max|logit| (the CPU backend computes the same
  equations; only the float32 accumulation order differs), the same greedy tokens and the same
  sampled tokens from `generate`, the same text through TextStreamer and pipeline;
- bfloat16: transformers' eager experts round every intermediate to bfloat16, the CPU backend
  rounds once; the streamed logits stay within transformers' own bfloat16-vs-float32 difference
  on the same weights, and the decisive greedy tokens agree;
- streamed output is bitwise identical across arena sizes, lookahead on/off, split turns and
  prompt chunking (I11);
- torch never reads the expert tensors: with them overwritten by NaN the output is unchanged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.convert.safetensors_index import SafetensorsIndex  # noqa: E402
from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import describe, load, stats_source  # noqa: E402
from strata_stream.transformers.experts import StreamedExperts  # noqa: E402
from strata_stream.transformers.random_model import CONFIGS, make_checkpoint  # noqa: E402

FAMILIES = list(CONFIGS)
PROMPT = [5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2, 17, 61, 4, 4, 30, 12, 50, 6]
NEW_TOKENS = 12
BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


def oracle(path: Path, dtype: str, device: str = "cpu") -> Any:
    """Plain transformers on `path`, on the CPU or (tests/cuda) on CUDA device 0."""
    placed = {} if device == "cpu" else {"device_map": {"": torch.device(device, 0)}}
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager",
        experts_implementation="eager", **placed,
    )  # fmt: skip


@torch.no_grad()
def logits(model: Any, tokens: list[int] = PROMPT) -> np.ndarray:
    return model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu().numpy()


def generate(model: Any, **kwargs: Any) -> list[int]:
    prompt = torch.tensor([PROMPT], device=model.device)
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    return [int(t) for t in out[0, len(PROMPT) :]]


def sample(model: Any) -> list[int]:
    torch.manual_seed(3)
    return generate(model, do_sample=True, temperature=0.8, top_k=0, top_p=1.0)


class Family:
    """One family's checkpoint, its pack and the oracle, on `device` (tests/cuda: "cuda", where
    the device-neutral tests of this module run again on that device's families)."""

    def __init__(self, name: str, root: Path, dtype: str, device: str = "cpu") -> None:
        self.name = name
        self.dtype = dtype
        self.device = device
        self.path = make_checkpoint(name, root / name, dtype=dtype)
        self.pack = convert(self.path, root / f"{name}.strpk", progress=False)
        with ExpertPack.open(self.pack) as p:
            self.stride = p.record_stride
            self.n_records = p.geometry.n_records
            self.top_k = p.geometry.top_k
        self.ref = oracle(self.path, dtype, device)
        self.ref_logits = logits(self.ref)

    def load(self, slots: int | None = None, path: Path | None = None, **cfg: Any) -> Any:
        n = slots if slots is not None else self.n_records
        return load(
            path or self.path,
            pack_path=self.pack,
            arena_bytes=n * self.stride,
            config=BASE.replace(**cfg),
            dtype=getattr(torch, self.dtype),
            device=self.device,
            attn_implementation="eager",
            progress=False,
        )


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("hf"), "float32")


@pytest.fixture(scope="module", params=FAMILIES)
def fam_bf16(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("hf_bf16"), "bfloat16")


def decisive(ref: np.ndarray, tolerance: float) -> np.ndarray:
    """Positions whose top-1 margin exceeds twice the logits' tolerance: no difference within
    the tolerance can change their top-1, so the streamed model must agree there."""
    top2 = np.sort(ref, axis=-1)[:, -2:]
    return np.asarray(top2[:, 1] - top2[:, 0] > 2 * tolerance)


def test_the_experts_modules_are_streamed(fam: Family, closing: list[Any]) -> None:
    model = fam.load()
    closing.append(model)
    streamed = [m for m in model.modules() if isinstance(m, StreamedExperts)]
    assert [m.layer for m in streamed] == list(range(len(streamed))) and streamed
    # No expert tensor is a parameter: from_pretrained had nowhere to put one.
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if ".experts." in n]
    assert any("gate" in n or "router" in n for n in names)  # the model's own routers stay


def test_float32_logits_and_generate_match_plain_transformers(
    fam: Family, closing: list[Any]
) -> None:
    model = fam.load(2 * fam.top_k + 1)
    closing.append(model)
    got = logits(model)
    ref = fam.ref_logits
    # The same float32 equations, accumulated in another order: ~3e-7 of max|logit| measured.
    tolerance = 1e-5 * np.abs(ref).max()
    diff = np.abs(got - ref).max()
    print(f"{fam.name} float32 {fam.device}: max|diff| {diff:.3g} of max|logit| "
          f"{np.abs(ref).max():.3g}")  # fmt: skip
    assert diff <= tolerance
    mask = decisive(ref, tolerance)
    assert mask.sum() >= len(PROMPT) // 2
    assert (got.argmax(-1) == ref.argmax(-1))[mask].all()
    assert generate(model, do_sample=False) == generate(fam.ref, do_sample=False)
    assert sample(model) == sample(fam.ref)
    stats = describe(model)["total"]
    assert stats["hits"] + stats["misses"] > 0
    snap = stats_source(model)()  # the server's metrics schema
    assert snap["hits"] == stats["hits"] and snap["slots_total"] == 2 * fam.top_k + 1


def test_bfloat16_within_transformers_own_bf16_rounding(
    fam_bf16: Family, closing: list[Any]
) -> None:
    fam = fam_bf16
    model = fam.load()
    closing.append(model)
    got = logits(model)
    ref = fam.ref_logits
    # transformers itself, on the same (bf16) weights evaluated in float32: its own
    # bfloat16-vs-float32 difference bounds how far a bf16 evaluation may honestly be.
    ref32 = logits(oracle(fam.path, "float32", fam.device))
    own = np.abs(ref - ref32).max()
    print(f"{fam.name} bfloat16 {fam.device}: streamed-vs-bf16 {np.abs(got - ref).max():.3g}, "
          f"own bf16-vs-f32 {own:.3g}")  # fmt: skip
    assert own > 0
    assert np.abs(got - ref).max() <= 2 * own
    assert np.abs(got - ref32).max() <= 2 * own
    # (Measured: streamed-vs-bf16 0.023-0.35, own 0.023-0.79, max|logit| 3.3-4.0.)
    mask = decisive(ref, own)
    assert mask.any()
    assert (got.argmax(-1) == ref.argmax(-1))[mask].all()
    # Greedy decoding teacher-forced on transformers' own tokens: every decisive step agrees.
    tokens = generate(fam.ref, do_sample=False)
    seq = PROMPT + tokens
    ref_seq = logits(fam.ref, seq)[len(PROMPT) - 1 : -1]
    got_seq = logits(model, seq)[len(PROMPT) - 1 : -1]
    assert list(ref_seq.argmax(-1)) == tokens
    assert (got_seq.argmax(-1) == ref_seq.argmax(-1))[decisive(ref_seq, own)].all()


def test_streamed_output_identical_across_configs(fam: Family, closing: list[Any]) -> None:
    base = fam.load()
    closing.append(base)
    want_logits, want_tokens = logits(base), generate(base, do_sample=False)
    k = fam.top_k
    for slots, cfg in (
        (2 * k, {}),
        (2 * k + 1, {"lookahead": False}),
        (2 * k + 2, {"split_turn": True}),
        (None, {"max_rows": 7, "two_layer_decode": True, "two_layer_prompt": True}),
    ):
        model = fam.load(slots, **cfg)
        closing.append(model)
        assert np.array_equal(logits(model), want_logits), (slots, cfg)
        assert generate(model, do_sample=False) == want_tokens, (slots, cfg)


def test_an_arena_of_every_expert_is_filled_at_load(fam: Family, closing: list[Any]) -> None:
    # Filled at load: no miss and no next-layer router afterwards. That it gives the small
    # arena's bits is test_streamed_output_identical_across_configs (fam.load() is this arena).
    full, part = fam.load(), fam.load(2 * fam.top_k)
    closing += [full, part]
    for model in (full, part):
        generate(model, do_sample=False)
    assert full.strata_engine.filled_at_load and not part.strata_engine.filled_at_load
    got = full.strata_engine.window.stats()["total"]
    assert got["misses"] == 0 and got["hits"] > 0
    assert got["pred_predicted"] == 0  # every layer resident for good
    small = part.strata_engine.window.stats()["total"]
    assert small["misses"] > 0 and small["pred_predicted"] > 0


def poison_experts(path: Path) -> int:
    """Overwrite every routed expert tensor in the shards with 0xFF bytes (NaN in bf16/f32).
    Each shard keeps its modification time, so the cheap provenance check on load (sizes,
    mtimes, headers: convert/source.py) still takes the clean pack as this checkpoint's."""
    with SafetensorsIndex(path) as index:
        spans = [(t.file, t.offset, t.nbytes) for n, t in index.tensors.items() if ".experts." in n]
    times = {file: os.stat(file) for file, _, _ in spans}
    for file, offset, nbytes in spans:
        fd = os.open(file, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * nbytes, offset)
        finally:
            os.close(fd)
    for file, st in times.items():
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    return len(spans)


def test_torch_never_reads_the_expert_tensors(
    fam: Family, tmp_path: Path, closing: list[Any]
) -> None:
    copy = tmp_path / "poisoned"
    shutil.copytree(fam.path, copy)
    assert poison_experts(copy) > 0
    # plain transformers reads them
    assert not np.isfinite(logits(oracle(copy, "float32", fam.device))).all()
    model = fam.load(path=copy)
    closing.append(model)
    clean = fam.load()
    closing.append(clean)
    got = logits(model)
    assert np.isfinite(got).all()
    assert np.array_equal(got, logits(clean))


@pytest.mark.parametrize("fam", ["qwen3_moe"], indirect=True)
def test_streamer_pipeline_and_caches_work_unchanged(
    fam: Family, closing: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(fam.path)
    model = fam.load(2 * fam.top_k)
    closing.append(model)

    def streamed_text(m: Any) -> str:
        streamer = transformers.TextStreamer(tokenizer, skip_prompt=True)
        inputs = tokenizer("w1 w2 w3", return_tensors="pt")
        m.generate(**inputs, max_new_tokens=6, do_sample=False, streamer=streamer)
        return capsys.readouterr().out

    want = streamed_text(fam.ref)
    assert want.strip()
    assert streamed_text(model) == want

    def piped(m: Any) -> str:
        pipe = transformers.pipeline("text-generation", model=m, tokenizer=tokenizer, device="cpu")
        out: str = pipe("w4 w5", max_new_tokens=5, do_sample=False)[0]["generated_text"]
        return out

    assert piped(model) == piped(fam.ref)
    # A left-padded batch of two prompts: the experts see [B * T, H] rows, pads included.
    tokenizer.padding_side = "left"
    batch = tokenizer(["w1 w2 w3 w4 w5", "w9 w8"], return_tensors="pt", padding=True)
    want_batch = fam.ref.generate(**batch, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=6, do_sample=False), want_batch)
    # The static cache too (generate's default is the dynamic one, used everywhere above).
    static = generate(model, do_sample=False, cache_implementation="static")
    assert static == generate(fam.ref, do_sample=False, cache_implementation="static")


@pytest.mark.parametrize("fam", ["mixtral"], indirect=True)
def test_first_load_converts_into_the_cache(
    fam: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    from strata_stream.convert.pack_cache import default_pack_path

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    pack = default_pack_path(fam.path)
    assert str(pack).startswith(str(tmp_path / "cache"))
    model = load(fam.path, arena_bytes=1 << 24, config=BASE, progress=False)
    closing.append(model)
    assert pack.exists() and model.strata_pack_path == pack
    made = pack.stat().st_mtime_ns
    model2 = load(fam.path, arena_bytes=1 << 24, config=BASE, progress=False)
    closing.append(model2)
    assert pack.stat().st_mtime_ns == made  # reused, not converted again
    assert np.array_equal(logits(model2), logits(model))
    # arena_bytes=None: sized from available memory, capped at every expert resident.
    model3 = load(fam.path, config=BASE, progress=False)
    closing.append(model3)
    assert model3.strata_engine.config.arena_bytes == fam.n_records * fam.stride


@pytest.mark.parametrize("fam", ["qwen3_moe"], indirect=True)
def test_bad_inputs_name_their_cause(fam: Family, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="below the minimum"):
        load(fam.path, pack_path=fam.pack, arena_bytes=fam.stride, config=BASE, progress=False)
    with pytest.raises(ConfigError, match="no such model directory"):
        load(tmp_path / "missing", config=BASE, progress=False)
    model = fam.load()
    try:
        window = model.strata_engine.window
        x = np.zeros((1, 64), np.float32)
        ids, w = np.zeros((1, fam.top_k), np.int32), np.ones((1, fam.top_k), np.float32)
        with pytest.raises(TypeError, match="4-byte elements, not bfloat16"):
            window.moe_routed(0, x, ids, w, x_dtype="bfloat16")
        with pytest.raises(TypeError, match="x_dtype must be"):
            window.moe_routed(0, x, ids, w, x_dtype="int8")
        # bfloat16 bits (as int16) named by x_dtype are read as bfloat16: 0x3F00 is 0.5.
        half = window.moe_routed(0, x + 0.5, ids, w)
        window.restart_pass()
        bits = np.full((1, 64), 0x3F00, np.int16)
        assert np.array_equal(window.moe_routed(0, bits, ids, w, x_dtype="bfloat16"), half)
        assert np.abs(half).max() > 0
    finally:
        model.strata_engine.close()
    other = make_checkpoint("olmoe", tmp_path / "olmoe")
    from strata_stream.errors import PackError

    with pytest.raises(PackError, match="was not made from the weights"):  # its provenance
        load(other, pack_path=fam.pack, config=BASE, progress=False)


@pytest.mark.parametrize("fam", ["qwen3_moe"], indirect=True)
def test_a_repo_id_is_fetched_with_the_files_convert_fetches(
    fam: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repo id goes to the hub (here a stand-in returning the family's checkpoint) with the
    patterns `convert` and mlx-lm fetch, so all of them share one snapshot and one pack; a
    directory without config.json is refused by name."""
    import huggingface_hub

    from strata_stream.paths import MODEL_FILES

    fetched: list[tuple[str, list[str] | None]] = []

    def snapshot_download(repo_id: str, revision: str | None = None,
                          allow_patterns: list[str] | None = None) -> str:  # fmt: skip
        fetched.append((repo_id, allow_patterns))
        return str(fam.path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = load("owner/model", pack_path=fam.pack, config=BASE, attn_implementation="eager",
                 progress=False)  # fmt: skip
    try:
        assert model.strata_model_dir == fam.path
    finally:
        model.strata_engine.close()
    assert fetched == [("owner/model", list(MODEL_FILES))]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="empty: no config.json"):
        load(empty, config=BASE, progress=False)


@pytest.mark.parametrize("fam", ["qwen2_moe"], indirect=True)
def test_cli_generate_with_the_transformers_engine(
    fam: Family, capsys: pytest.CaptureFixture[str]
) -> None:
    from strata_stream.cli import main

    tokenizer = transformers.AutoTokenizer.from_pretrained(fam.path)
    inputs = tokenizer("w1 w2 w3", return_tensors="pt")
    ids = fam.ref.generate(**inputs, max_new_tokens=5, do_sample=False)
    want = tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    arena = str(6 * fam.stride / (1 << 30))
    args = ["generate", str(fam.path), "--engine", "transformers", "--prompt", "w1 w2 w3",
            "--max-tokens", "5", "--arena-gb", arena, "--pack", str(fam.pack)]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(want)
    assert "decode " in out and "hit rate" in out and "6 expert slots" in out
    for extra in (["--experts", "mlx"], ["--tensor"], ["--device", "cuda"]):
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err, extra


@pytest.mark.parametrize("fam", ["qwen3_moe"], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_x_is_read_in_place(
    fam: Family, dtype: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The experts call hands the Window a host view of the torch tensor's own memory: no copy
    # of x, whatever its dtype (bfloat16 as its 16-bit patterns). No lookahead: the float32
    # model's routers would refuse a bfloat16 x.
    model = fam.load(lookahead=False)
    closing.append(model)
    engine = model.strata_engine
    seen: list[int] = []
    real = engine.window.moe_routed

    def spy(layer: int, x: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(x.__array_interface__["data"][0])
        return real(layer, x, *args, **kwargs)

    monkeypatch.setattr(engine.window, "moe_routed", spy)
    x = torch.randn(3, 64).to(getattr(torch, dtype))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    y = engine.run(0, x, ids, torch.full((3, 2), 0.5))
    assert seen == [x.data_ptr()]
    assert y.dtype == x.dtype and y.shape == x.shape
