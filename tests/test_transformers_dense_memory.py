"""The transformers front-end's dense weights in host memory (transformers/dense_memory.py).

transformers maps a checkpoint's tensors from its safetensors files. After load:
- the weights a step reads whole are anonymous memory (not file pages the kernel can drop and
  read again every token) and counted whole in describe()["dense_bytes"];
- the input embedding, a tensor of its own (not tied to the head), stays mapped and is counted
  as the rows of one prompt chunk, so the arena budget gets the rest;
- an embedding tied to the head is the head: resident and counted whole;
- the values are the checkpoint's and the outputs bitwise what they were before the copy.
Where a tensor sits is read here from /proc/self/maps by the test's own parser.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from strata_stream.convert import convert  # noqa: E402
from strata_stream.pack.reader import ExpertPack  # noqa: E402
from strata_stream.transformers import describe, load  # noqa: E402
from strata_stream.transformers.random_model import make_checkpoint  # noqa: E402
from test_transformers_families import BASE, logits, oracle  # noqa: E402

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/maps"
)
VOCAB = 4096  # rows enough that one prompt chunk's (max_rows) are a part of the embedding


def _mapped_file(t: Any) -> str | None:
    """The file whose mapping holds t's first byte, or None where that is anonymous memory."""
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                path = parts[5] if len(parts) > 5 else ""
                return path if parts[4] != "0" and path.startswith("/") else None
    raise AssertionError(f"address {address:#x} is in no mapping")


def _tensors(model: Any) -> dict[int, tuple[str, Any]]:
    """The model's host tensors by address (tied ones once), with a name for each."""
    found: dict[int, tuple[str, Any]] = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device.type == "cpu" and t.numel():
            found.setdefault(t.data_ptr(), (name, t))
    return found


class Model:
    def __init__(self, root: Path, tied: bool) -> None:
        dims = {"vocab_size": VOCAB, "tie_word_embeddings": tied}
        self.path = make_checkpoint("qwen3_moe", root / "m", dims=dims)
        self.pack = convert(self.path, root / "m.strpk", progress=False)
        with ExpertPack.open(self.pack) as p:
            self.arena = p.geometry.n_records * p.record_stride
        self.ref = oracle(self.path, "float32")

    def load(self) -> Any:
        return load(self.path, pack_path=self.pack, arena_bytes=self.arena, config=BASE,
                    dtype=torch.float32, attn_implementation="eager", progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(tmp_path_factory.mktemp("dense_untied"), tied=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(tmp_path_factory.mktemp("dense_tied"), tied=True)


def test_the_embedding_stays_mapped_and_counts_the_rows_a_step_reads(
    untied: Model, closing: list[Any]
) -> None:
    model = untied.load()
    closing.append(model)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() != embed.data_ptr()
    path = _mapped_file(embed)
    assert path is not None and path.endswith(".safetensors"), path
    others = {p: nt for p, nt in _tensors(model).items() if p != embed.data_ptr()}
    assert others
    on_file = [name for name, t in others.values() if _mapped_file(t) is not None]
    assert not on_file, f"read whole, yet pages of the checkpoint's files: {on_file}"
    whole = sum(t.numel() * t.element_size() for _, t in others.values())
    rows = model.strata_engine.config.max_rows
    embed_bytes = embed.numel() * embed.element_size()
    share = rows * embed.shape[1] * embed.element_size()
    assert share < embed_bytes  # the checkpoint is made so that the share is a part
    d = describe(model)
    assert d["dense_bytes"] == whole + share
    assert d["dense_mapped_bytes"] == embed_bytes
    assert d["dense_resident_bytes"] == whole


def test_the_values_are_the_checkpoints_and_the_outputs_plain_transformers(
    untied: Model, closing: list[Any]
) -> None:
    model = untied.load()
    closing.append(model)
    ref = dict(untied.ref.named_parameters())
    for name, t in model.named_parameters():
        assert torch.equal(t, ref[name]), name
    got, want = logits(model), logits(untied.ref)
    # The experts' float32 sums in another order than transformers' (as
    # test_transformers_families bounds them); the dense weights are the same tensors.
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_copy_leaves_every_output_bitwise(untied: Model) -> None:
    """settle on plain transformers: the logits before and after are the same bits."""
    from strata_stream.transformers.dense_memory import settle

    model = oracle(untied.path, "float32")
    before = logits(model)
    head = model.get_output_embeddings().weight
    assert _mapped_file(head) is not None  # transformers mapped it from the file
    found = settle(model, rows=16)
    assert _mapped_file(model.get_output_embeddings().weight) is None
    assert found.copied > 0 and found.mapped == model.get_input_embeddings().weight.nbytes
    assert np.array_equal(logits(model), before)


def test_an_embedding_tied_to_the_head_is_resident_and_counted_whole(
    tied: Model, closing: list[Any]
) -> None:
    model = tied.load()
    closing.append(model)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed  # still one tensor
    assert _mapped_file(embed) is None
    whole = sum(t.numel() * t.element_size() for _, t in _tensors(model).values())
    d = describe(model)
    assert d["dense_bytes"] == d["dense_resident_bytes"] == whole
    assert d["dense_mapped_bytes"] == 0
    got, want = logits(model), logits(tied.ref)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_without_proc_maps_nothing_moves_and_everything_counts(
    untied: Model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where the mappings cannot be read (not Linux), the tensors stay as they are and count
    whole, as before the front-end told them apart."""
    from strata_stream.transformers import dense_memory

    monkeypatch.setattr(dense_memory, "PROC_MAPS", str(tmp_path / "absent"))
    model = oracle(untied.path, "float32")
    found = dense_memory.settle(model, rows=16)
    whole = sum(t.numel() * t.element_size() for _, t in _tensors(model).values())
    assert (found.resident, found.counted, found.mapped, found.copied) == (whole, whole, 0, 0)
    assert _mapped_file(model.get_output_embeddings().weight) is not None


def test_a_strided_view_of_a_mapped_file_stays_mapped_and_counts_whole(tmp_path: Path) -> None:
    """Only a plain contiguous tensor is copied (a copy of the same shape and dtype replaces it
    exactly); a transposed view of the same file pages stays where it is, reads the same values
    after its neighbour's pages were paged out, and counts whole."""
    from strata_stream.transformers.dense_memory import settle

    values = np.arange(64 * 32, dtype=np.float32)
    values.tofile(tmp_path / "w.bin")
    mapped = torch.from_file(str(tmp_path / "w.bin"), shared=False, size=values.size,
                             dtype=torch.float32).view(64, 32)  # fmt: skip
    assert _mapped_file(mapped) is not None
    model = torch.nn.Module()
    model.a = torch.nn.Linear(32, 64, bias=False)
    model.b = torch.nn.Linear(64, 32, bias=False)
    model.a.weight = torch.nn.Parameter(mapped, requires_grad=False)
    model.b.weight = torch.nn.Parameter(mapped.t(), requires_grad=False)
    found = settle(model, rows=4)
    assert _mapped_file(model.a.weight) is None and _mapped_file(model.b.weight) is not None
    assert (found.copied, found.resident, found.mapped) == (values.nbytes, 2 * values.nbytes, 0)
    assert np.array_equal(model.a.weight.numpy().ravel(), values)
    assert np.array_equal(model.b.weight.numpy(), values.reshape(64, 32).T)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"address {address:#x} is in no mapping")


def test_a_large_copy_asks_for_huge_pages(tmp_path: Path) -> None:
    """A copy of several huge pages' size is advised MADV_HUGEPAGE before it is touched (the
    mapping's VmFlags say 'hg'), as the page cache maps the checkpoint in large folios."""
    from strata_stream.transformers.dense_memory import settle

    n = 3 * (2 << 20) // 4  # float32 values: three huge pages' bytes
    np.arange(n, dtype=np.float32).tofile(tmp_path / "w.bin")
    mapped = torch.from_file(str(tmp_path / "w.bin"), shared=False, size=n, dtype=torch.float32)
    model = torch.nn.Module()
    model.a = torch.nn.Linear(n // 64, 64, bias=False)
    model.a.weight = torch.nn.Parameter(mapped.view(64, n // 64), requires_grad=False)
    settle(model, rows=4)
    w = model.a.weight
    assert _mapped_file(w) is None
    assert "hg" in _vm_flags(w.data_ptr() + w.numel() * w.element_size() // 2)
    assert np.array_equal(w.numpy().ravel(), np.arange(n, dtype=np.float32))


def test_copies_a_container_cannot_hold_are_not_made_and_sizing_refuses(
    untied: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies bigger than a container's limit leaves would have the process killed during
    them, with no message: none is made, and an arena sized from the memory is refused in one
    line naming the dense weights and the limit."""
    from strata_stream import container_memory
    from strata_stream.errors import ConfigError

    monkeypatch.setattr(container_memory, "binding", lambda: (3 << 30, 1 << 20))
    with pytest.raises(ConfigError, match="not enough memory for the dense weights") as e:
        load(untied.path, pack_path=untied.pack, config=BASE, dtype=torch.float32,
             attn_implementation="eager", progress=False)  # fmt: skip
    assert "1.00 MiB is left of this container's 3.00 GiB limit" in str(e.value)
    assert "pass arena_bytes" in str(e.value)


def test_an_explicit_arena_streams_with_the_weights_held_back_mapped(
    untied: Model, monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    from strata_stream.transformers import dense_memory

    monkeypatch.setattr(dense_memory, "_copy_room", lambda: 0)
    model = untied.load()
    closing.append(model)
    head = model.get_output_embeddings().weight
    assert _mapped_file(head) is not None  # left where transformers mapped it
    d = describe(model)
    embed = model.get_input_embeddings().weight.data_ptr()
    on_file = [t for p, (_, t) in _tensors(model).items() if p != embed and _mapped_file(t)]
    whole = sum(t.numel() * t.element_size() for t in on_file)  # built in memory: resident
    assert d["dense_copied_bytes"] == 0
    assert d["dense_held_back_bytes"] == whole
    got, want = logits(model), logits(untied.ref)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
