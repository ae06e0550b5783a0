"""The pinned llama.cpp cut down to what the peer comparison builds and runs, as one archive.

    python benchmarks/peers/llama_trim.py [--sdist PATH] [--out .peers-src/llama.cpp-trim.tar.xz]
        [--extract-to DIR]

The GPU machine reaches nothing outside itself, so the source its llama.cpp CUDA build starts
from travels with the working tree, where everything together must stay under 64 MiB. The
llama-cpp-python sdist pinned in llama_build.py (its SHA-256 is checked here too) is 73 MB; its
vendored llama.cpp keeps, here:
- the libraries: the top-level CMake project, cmake/, include/, src/, common/, vendor/, and
  ggml with its CPU and CUDA backends alone (a backend's folder is read only when its option is
  on);
- tools/quantize (llama-quantize), the one tool the comparison runs;
- convert_hf_to_gguf.py with conversion/ and gguf-py/ (the GGUF converter).
The folders that CMake reads unconditionally but whose targets the comparison never builds
(tools/, examples/, pocs/, tests/, app/) keep a CMakeLists.txt that adds nothing, tools/'s
adding quantize alone; everything else (models/ with its test vocabularies, docs/, the other
backends, the other tools) is left out. The archive holds one folder, `llama.cpp/`, and
TRIMMED.txt saying what was cut. Both llama_build.py's CPU build and the CUDA build of
benchmarks/peers/gpu_rows.py configure and build from it.

--out defaults to `.peers-src/` in the repository root, which .gitignore ignores: the device
tool carries it only when named (its `carry` list).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
import time
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from llama_build import SDIST, SDIST_SHA256  # noqa: E402

ROOT = HERE.parent.parent
PREFIX = PurePosixPath(SDIST.removesuffix(".tar.gz")) / "vendor" / "llama.cpp"
DEFAULT_OUT = ROOT / ".peers-src" / "llama.cpp-trim.tar.xz"

# Top-level files and folders kept whole (below PREFIX).
KEEP_FILES = {"CMakeLists.txt", "LICENSE", "convert_hf_to_gguf.py"}
KEEP_DIRS = {"cmake", "common", "conversion", "gguf-py", "include", "licenses", "src", "vendor"}
# ggml/src/<backend> folders kept: CPU and CUDA (ggml-cuda's sources are globbed whole).
GGML_BACKENDS = {"ggml-cpu", "ggml-cuda"}
# Folders whose CMakeLists.txt the top level adds unconditionally or by default options: a stub
# that adds nothing, except tools/, which adds quantize alone.
STUB = "# Left out of the peer comparison's trimmed llama.cpp (benchmarks/peers/llama_trim.py).\n"
STUBS = {
    "tools/CMakeLists.txt": STUB + "llama_add_compile_flags()\nadd_subdirectory(quantize)\n",
    "examples/CMakeLists.txt": STUB,
    "pocs/CMakeLists.txt": STUB,
    "tests/CMakeLists.txt": STUB,
    "app/CMakeLists.txt": STUB,
}
SKIP_PARTS = {"__pycache__", ".github", ".devops"}


def kept(rel: PurePosixPath) -> bool:
    """Whether the file at rel (a path inside llama.cpp/) is in the trimmed tree."""
    parts = rel.parts
    if not parts or SKIP_PARTS.intersection(parts):
        return False
    if len(parts) == 1:
        return parts[0] in KEEP_FILES
    top = parts[0]
    if top in KEEP_DIRS:
        return not (top == "gguf-py" and parts[1] == "tests")
    if top == "tools":
        return parts[1] == "quantize"
    if top == "ggml":
        if parts[1] in ("include", "cmake") or len(parts) == 2:
            return True
        if parts[1] == "src":
            return len(parts) == 3 or parts[2] in GGML_BACKENDS
    return False


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _add_bytes(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    out.addfile(info, io.BytesIO(data))


def trim(sdist: Path, dest: Path) -> dict[str, int]:
    """Writes the archive at dest (through dest.partial); returns counts of what it holds."""
    digest = _digest(sdist)
    if digest != SDIST_SHA256:
        sys.exit(f"{sdist}: SHA-256 {digest}, expected {SDIST_SHA256} (llama_build.py's pin)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    counts = {"files": 0, "bytes": 0, "left_out": 0}
    with tarfile.open(sdist) as src, tarfile.open(partial, "w:xz", preset=6) as out:
        for m in src:
            try:
                rel = PurePosixPath(m.name).relative_to(PREFIX)
            except ValueError:
                continue
            if not (m.isfile() or m.issym()):
                continue
            if str(rel) in STUBS:
                continue
            if not kept(rel):
                counts["left_out"] += 1
                continue
            m.name = str(PurePosixPath("llama.cpp") / rel)
            # A long name's PAX header still holds the sdist's path, which would win over name.
            m.pax_headers = {
                k: v for k, v in m.pax_headers.items() if k not in ("path", "linkpath")
            }
            m.uid = m.gid = 0
            m.uname = m.gname = ""
            out.addfile(m, src.extractfile(m) if m.isfile() else None)
            counts["files"] += 1
            counts["bytes"] += m.size
        for rel_name, text in STUBS.items():
            _add_bytes(out, f"llama.cpp/{rel_name}", text.encode())
        note = (
            f"Trimmed from {SDIST} (SHA-256 {SDIST_SHA256}), its vendor/llama.cpp, by "
            "benchmarks/peers/llama_trim.py.\nStubbed (adding nothing, tools/ adding quantize "
            f"alone): {', '.join(sorted(STUBS))}.\n{counts['left_out']} files left out.\n"
        )
        _add_bytes(out, "llama.cpp/TRIMMED.txt", note.encode())
    partial.rename(dest)
    return counts


def extract(archive: Path, into: Path) -> Path:
    """The archive's llama.cpp/ under into (once: an existing CMakeLists.txt is kept)."""
    source = into / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data")
    return source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sdist", type=Path, default=None, help="default: llama_build's workdir")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--extract-to", type=Path, default=None, help="also unpack it here")
    a = p.parse_args()
    if a.sdist is None:
        from llama_build import default_workdir

        a.sdist = default_workdir() / SDIST
    if not a.sdist.exists():
        p.error(f"{a.sdist}: no such sdist (llama_build.py fetches it; or give --sdist)")
    if not a.out.exists():
        t0 = time.perf_counter()
        c = trim(a.sdist, a.out)
        print(
            f"wrote {a.out}: {c['files']} files ({c['bytes'] / 1e6:.1f} MB) in "
            f"{a.out.stat().st_size / 1e6:.1f} MB, {c['left_out']} files left out, "
            f"{time.perf_counter() - t0:.0f} s"
        )
    else:
        print(f"{a.out} exists ({a.out.stat().st_size / 1e6:.1f} MB)")
    if a.extract_to:
        print(extract(a.out, a.extract_to))


if __name__ == "__main__":
    main()
