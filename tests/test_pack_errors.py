"""Every way a pack can be malformed is reported as a PackError naming the file and the field."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_stream import ExpertStream, StreamConfig, testing
from strata_stream.cli import main
from strata_stream.errors import PackError
from strata_stream.pack import ExpertPack, pack_preset
from strata_stream.pack.header import HEADER_BYTES, PackHeader, parse_header


@pytest.fixture(scope="module")
def good_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_preset("tiny", tmp_path_factory.mktemp("good") / "tiny.strpk", progress=False)


@pytest.fixture
def pack(good_pack: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny pack, free to corrupt."""
    return Path(shutil.copy(good_pack, tmp_path / "bad.strpk"))


def patch(path: Path, offset: int, data: bytes, fix_header_crc: bool = True) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        if fix_header_crc:
            f.seek(0)
            head = f.read(4092)
            f.write(struct.pack("<I", zlib.crc32(head)))


def u64(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return int(struct.unpack("<Q", f.read(8))[0])


def expect(path: Path, message: str) -> None:
    with pytest.raises(PackError, match=f"^pack {re.escape(str(path))}: {message}"):
        ExpertPack.open(path)


def test_bad_magic(pack: Path) -> None:
    patch(pack, 0, b"XXXXXXXX")
    expect(pack, re.escape("bad magic b'XXXXXXXX' (expected b'STRATAPK')"))


def test_not_a_pack_at_all(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    expect(p, "bad magic b'hello'")


def test_bad_version(pack: Path) -> None:
    patch(pack, 8, struct.pack("<I", 5))
    expect(
        pack,
        re.escape("version 5 not supported (this reader knows 2, 3 and 4) (written by a newer"),
    )


def test_version_4_without_its_features_is_refused(pack: Path) -> None:
    patch(pack, 8, struct.pack("<I", 4))
    expect(pack, re.escape("version 4 header whose experts are gated swiglu or swiglu_oai"))


def test_version_1_is_refused_with_a_repack_hint(pack: Path) -> None:
    # Version 1 stored zlib CRC-32 record checksums; reading it as version 2 would report every
    # record as corrupt, so both readers refuse it up front, naming the file and the fix.
    patch(pack, 8, struct.pack("<I", 1))
    expect(
        pack,
        re.escape(
            "format version 1 is no longer read (version 2 checksums records with CRC32C); "
            "repack with strata-stream pack/convert"
        ),
    )


def test_bad_activation_and_bias_format(pack: Path) -> None:
    patch(pack, 1024, struct.pack("<I", 7))
    expect(pack, "header field activation is 7")
    patch(pack, 1024, struct.pack("<I", 0))
    patch(pack, 1036, struct.pack("<I", 9))
    expect(pack, "header field bias_format is 9")


def test_header_crc_mismatch(pack: Path) -> None:
    patch(pack, 16, struct.pack("<I", 5), fix_header_crc=False)
    expect(pack, "header_crc mismatch")


def test_truncated_file(pack: Path) -> None:
    size = pack.stat().st_size
    os.truncate(pack, size - 100)
    expect(pack, f"file is {size - 100} bytes but header field file_bytes says {size} \\(truncated")


def test_trailing_data(pack: Path) -> None:
    size = pack.stat().st_size
    with open(pack, "ab") as f:
        f.write(b"\0" * 10)
    expect(pack, f"file is {size + 10} bytes but header field file_bytes says {size} \\(trailing")


def test_shorter_than_header(pack: Path) -> None:
    os.truncate(pack, 1000)
    expect(pack, "file is 1000 bytes, shorter than the 4096-byte header")


def test_file_bytes_field_disagrees(pack: Path) -> None:
    size = pack.stat().st_size
    patch(pack, 128, struct.pack("<Q", size - 16384))
    msg = f"header field file_bytes is {size - 16384} but the geometry and format imply {size}"
    expect(pack, msg)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (88, 8192, "header field router_offset is 8192"),
        (64, 4096, "header field record_stride is 4096"),
        (44, 9, "header field weight_format is 9"),
        (36, 3, "header field routing is 3"),
        (12, 512, "header field header_bytes is 512"),
        (24, 17, re.escape("header field top_k is 17 (expected 1..n_experts 16)")),
        (48, 64, "header fields group_size 64 and scale_format 0 must be 0 for weight_format f16"),
        (144 + 32 + 8, 1, "tensor table entry 1 field offset is 1 but the geometry"),
    ],
)
def test_bad_header_fields(pack: Path, offset: int, value: int, message: str) -> None:
    width = 8 if offset in (64, 88, 144 + 32 + 8) else 4
    patch(pack, offset, value.to_bytes(width, "little"))
    expect(pack, message)


def _rewrite_metadata(path: Path, blob: bytes) -> None:
    # Same length (so no offsets move), with meta_crc and header_crc made consistent again.
    assert len(blob) == u64(path, 80)
    patch(path, 4096, blob, fix_header_crc=False)
    patch(path, 140, struct.pack("<I", zlib.crc32(blob)))


def _metadata(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(4096)
        return f.read(u64(path, 80))


def test_metadata_crc_mismatch(pack: Path) -> None:
    blob = bytearray(_metadata(pack))
    blob[5] ^= 0x20
    patch(pack, 4096, bytes(blob), fix_header_crc=False)
    expect(pack, "meta_crc mismatch")


def test_metadata_json_corrupt(pack: Path) -> None:
    blob = _metadata(pack)
    _rewrite_metadata(pack, b"{" + blob[1:-1] + b"!")
    expect(pack, "JSON metadata is not valid UTF-8 JSON")


def test_metadata_disagrees_with_header(pack: Path) -> None:
    blob = _metadata(pack).replace(b'"n_layers": 4', b'"n_layers": 5')
    _rewrite_metadata(pack, blob)
    expect(pack, "JSON metadata disagrees with header: field geometry.n_layers 5 vs 4")


def test_metadata_type_disagrees(pack: Path) -> None:
    blob = _metadata(pack).replace(b'"norm_topk_prob": true', b'"norm_topk_prob": 1   ')
    assert json.loads(blob)["geometry"]["norm_topk_prob"] == 1
    _rewrite_metadata(pack, blob)
    expect(pack, "JSON metadata disagrees with header: field geometry.norm_topk_prob 1 vs true")


def test_metadata_missing_field(pack: Path) -> None:
    blob = _metadata(pack).replace(b'"record_stride"', b'"record_strid_"')
    _rewrite_metadata(pack, blob)
    expect(pack, "JSON metadata disagrees with header: field record_stride is missing")


def test_record_checksum_mismatch(pack: Path) -> None:
    with ExpertPack.open(pack) as p:
        offset = p.record_offset(2, 5)
        expected = p.checksum(2, 5)
    patch(pack, offset + 100, b"\xff\xfe", fix_header_crc=False)
    with ExpertPack.open(pack) as p:  # opening does not read records
        with pytest.raises(PackError) as info:
            p.verify(progress=False)
        # Records before the bad one still read fine.
        assert p.expert_weights(2, 4)[0].shape == (32, 64)
    msg = str(info.value)
    assert f"pack {pack}: record (layer 2, expert 5) at offset {offset}" in msg
    assert f"expected crc32c {expected:#010x}, actual 0x" in msg


def test_router_checksum_mismatch(pack: Path) -> None:
    patch(pack, u64(pack, 88) + 4, b"\x01\x02\x03\x04", fix_header_crc=False)
    with ExpertPack.open(pack) as p, pytest.raises(PackError, match="routers at offset 16384"):
        p.verify(progress=False)


def test_cli_verify_names_bad_record(pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ExpertPack.open(pack) as p:
        offset = p.record_offset(3, 0)
    patch(pack, offset, b"\x00\x00\x00\x01", fix_header_crc=False)
    assert main(["verify", "--quiet", str(pack)]) == 1
    err = capsys.readouterr().err
    assert "verify failed" in err and "record (layer 3, expert 0)" in err
    assert err.count("\n") == 1


def test_cli_verify_unreadable_pack(pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    patch(pack, 0, b"NOTAPACK")
    assert main(["verify", str(pack)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata-stream: error: pack ") and "bad magic" in err
    assert "Traceback" not in err


# ---- crafted headers through the C++ engine -----------------------------------------------------

_U32_MAX, _U64_MAX = 2**32 - 1, 2**64 - 1
# (offset, width) of every fixed header field from version on, and of every tensor-table field.
_HEADER_FIELDS = (
    [(off, 4) for off in range(8, 56, 4)]
    + [(off, 8) for off in range(56, 136, 8)]
    + [(136, 4), (140, 4), (4088, 4)]
    + [
        (144 + 32 * i + rel, width)
        for i in range(9)
        for rel, width in ((0, 4), (4, 4), (8, 8), (16, 8), (24, 4), (28, 4))
    ]
)


@st.composite
def _field_changes(draw: st.DrawFn) -> list[tuple[int, int, int | None, int]]:
    """(offset, width, absolute value or None, delta) for 1-3 fields."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        off, width = draw(st.sampled_from(_HEADER_FIELDS))
        top = _U32_MAX if width == 4 else _U64_MAX
        value = draw(
            st.none()  # relative to the current value
            | st.sampled_from([0, 1, top, top - 1, top - 255, 2**31, 2**32 - 1, 2**32])
            | st.integers(0, top)
        )
        delta = draw(st.sampled_from([1, -1, 256, -256, 16384, 2**32, -(2**32)]))
        out.append((off, width, value, delta))
    return out


@pytest.fixture(scope="module")
def base_packs(make_pack: Any, good_pack: Path) -> list[Path]:
    q4 = make_pack(n_layers=2, n_experts=4, top_k=2, hidden=64, moe_intermediate=64,
                   weight_format="q4", group_size=32)  # fmt: skip
    return [good_pack, q4]


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    which=st.integers(0, 1),
    changes=_field_changes(),
    resize=st.booleans(),
)
def test_crafted_headers_are_a_pack_error_or_a_working_stream(
    base_packs: list[Path], tmp_path_factory: pytest.TempPathFactory, which: int,
    changes: list[tuple[int, int, int | None, int]], resize: bool,
) -> None:  # fmt: skip
    """Fields of the fixed header and tensor table changed to random and boundary values with
    the header crc recomputed, opened by the C++ engine through ExpertStream: a PackError naming
    the file, or a stream that works; never a crash, another error or a hang. The stream and the
    Python reader's parse_header (the same parser, through _core.read_layout, and the writer's
    layout rule) accept exactly the same headers."""
    path = Path(shutil.copy(base_packs[which], tmp_path_factory.mktemp("crafted") / "c.strpk"))
    with open(path, "rb") as f:
        head = bytearray(f.read(HEADER_BYTES))
    for off, width, value, delta in changes:
        fmt = "<I" if width == 4 else "<Q"
        top = _U32_MAX if width == 4 else _U64_MAX
        current = struct.unpack_from(fmt, head, off)[0]
        new = (value if value is not None else current + delta) & top
        struct.pack_into(fmt, head, off, new)
    struct.pack_into("<I", head, 4092, zlib.crc32(bytes(head[:4092])))
    patch(path, 0, bytes(head), fix_header_crc=False)
    claimed = struct.unpack_from("<Q", head, 128)[0]
    if resize and claimed <= 64 << 20:  # let a consistent file_bytes meet a file of that size
        os.truncate(path, claimed)
    size = os.path.getsize(path)

    try:
        py_header: PackHeader | None = parse_header(bytes(head), f"pack {path}")
    except PackError:
        py_header = None
    stride = struct.unpack_from("<Q", head, 64)[0]
    top_k = struct.unpack_from("<I", head, 24)[0]
    arena = min(max(2 * top_k * stride, 1 << 20), 256 << 20)
    config = StreamConfig(arena_bytes=arena, io_threads=1, direct_io=False)
    try:
        stream = ExpertStream(path, config)
    except PackError as e:
        assert str(e).startswith(f"pack {path}: "), str(e)
        if py_header is not None and size == py_header.file_bytes:
            g = py_header.geometry
            assert g.n_layers > 4096 or g.n_experts > 65536, (
                f"the engine refused a header the Python reader accepts: {e}"
            )
        return
    with stream:
        assert py_header is not None, "the engine accepted a header the Python reader refuses"
        assert size == py_header.file_bytes
        assert (stream.n_layers, stream.n_experts) == (
            py_header.geometry.n_layers,
            py_header.geometry.n_experts,
        )
        testing.wait(stream, stream.n_layers - 1, [stream.n_experts - 1])
        assert testing.check_invariants(stream) == ""
