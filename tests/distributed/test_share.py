"""A rank's share of the experts, in one process: what a share holds, what it refuses, where it
is cached, and how the ranks on one host split its memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_models import make_checkpoint  # noqa: E402
from strata_stream import ExpertPack  # noqa: E402
from strata_stream.convert import Share, convert  # noqa: E402
from strata_stream.errors import ConfigError, PackError  # noqa: E402
from strata_stream.mlx_lm import load  # noqa: E402
from strata_stream.mlx_lm.distributed import local_ranks  # noqa: E402
from strata_stream.mlx_lm.loader import default_pack_path  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("share") / "qwen3_moe")


def test_share_checks_its_fields() -> None:
    with pytest.raises(ConfigError, match="not a non-empty range"):
        Share(layers=(3, 3))
    with pytest.raises(ConfigError, match="slice 2 of 2"):
        Share(tp_rank=2, tp_size=2)
    assert Share().whole and not Share(layers=(0, 1)).whole
    assert Share(layers=(2, 4), tp_rank=1, tp_size=2).suffix() == "-pp2-4-tp1of2"
    s = Share(layers=(2, 4), tp_rank=1, tp_size=2)
    assert Share.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_tensor_share_needs_whole_quantization_groups(qwen: Path, tmp_path: Path) -> None:
    # The tiny qwen3_moe has moe_intermediate 64 and group 64: half a group per rank.
    with pytest.raises(ConfigError, match=r"32 of the experts' 64 .* groups of 64"):
        convert(qwen, tmp_path / "x.strpk", progress=False, share=Share(tp_rank=0, tp_size=2))
    with pytest.raises(ConfigError, match="divisible by 3"):
        convert(qwen, tmp_path / "x.strpk", progress=False, share=Share(tp_rank=0, tp_size=3))
    assert not (tmp_path / "x.strpk").exists()


def test_share_without_moe_layers_is_refused(qwen: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no MoE layer"):
        convert(qwen, tmp_path / "x.strpk", progress=False, share=Share(layers=(10, 12)))


def test_pipeline_share_pack_renumbers_its_layers(qwen: Path, tmp_path: Path) -> None:
    part = convert(qwen, tmp_path / "part.strpk", progress=False, share=Share(layers=(1, 3)))
    whole = convert(qwen, tmp_path / "whole.strpk", progress=False)
    with ExpertPack.open(part) as p, ExpertPack.open(whole) as w:
        assert p.geometry.n_layers == 2 and w.geometry.n_layers == 3
        assert p.metadata["model"]["decoder_layers"] == [1, 2]
        assert p.metadata["model"]["share"] == {"layers": [1, 3], "tp_rank": 0, "tp_size": 1}
        for e in range(w.geometry.n_experts):
            assert p.read_record(0, e) == w.read_record(1, e)
            assert p.read_record(1, e) == w.read_record(2, e)


def test_pack_of_another_share_is_refused(qwen: Path, tmp_path: Path) -> None:
    part = convert(qwen, tmp_path / "part.strpk", progress=False, share=Share(layers=(1, 3)))
    with pytest.raises(PackError, match="decoder layers 1..2 .* needs the whole model"):
        load(str(qwen), pack_path=part, progress=False)


def test_default_pack_path_names_the_share(qwen: Path) -> None:
    whole = default_pack_path(qwen)
    part = default_pack_path(qwen, Share(tp_rank=1, tp_size=2))
    assert part.name == whole.name.replace(".strpk", "-tp1of2.strpk")


def test_local_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATA_LOCAL_RANKS", raising=False)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5002"]]))
    assert local_ranks(0, str(hostfile)) == 2
    assert local_ranks(2, str(hostfile)) == 1
    assert local_ranks(0, str(tmp_path / "missing")) == 1
    monkeypatch.setenv("STRATA_LOCAL_RANKS", "4")
    assert local_ranks(0, str(hostfile)) == 4
    monkeypatch.setenv("STRATA_LOCAL_RANKS", "two")
    with pytest.raises(ConfigError, match="STRATA_LOCAL_RANKS"):
        local_ranks(0, str(hostfile))
