"""The extension modules export PyInit_<name> and nothing else, above all no C++ runtime names.

A C++ standard library symbol exported from an extension can bind to another copy of the
library in the same process (a statically linked libstdc++ meeting the system's
libstdc++.so.6, loaded by another module), and the two copies' data then disagree: one such
build crashed in libstdc++'s codecvt at the first engine error message that formatted a number.
CMakeLists.txt (strata_private_runtime) keeps every symbol private; these tests read the built
modules' dynamic symbol tables (ELF, parsed here: no binutils needed) and fail on any export
beyond PyInit_<name>.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

# Mangled names of namespace std (and libstdc++'s __gnu_cxx), whatever they name: functions
# (_ZNSt..., _ZNKSt..., _ZSt...), typeinfo and vtables (_ZTISt..., _ZTVNSt...), guard variables
# and function-local statics (_ZGVNSt..., _ZZNSt...).
_STD = re.compile(r"^_Z(?:T[ISVT]|GV|Z)?N?[KVr]*(?:St|9__gnu_cxx)")
_SHT_DYNSYM, _SHN_UNDEF, _STB_LOCAL, _STV_DEFAULT, _STV_PROTECTED = 11, 0, 0, 0, 3


def exported_symbols(path: Path) -> list[str]:
    """The names an ELF shared object exports: defined, non-local, default or protected
    visibility entries of its .dynsym. ValueError if the file is not ELF."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    wide, end = data[4] == 2, "<" if data[5] == 1 else ">"
    if wide:
        shoff = struct.unpack_from(end + "Q", data, 0x28)[0]
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        shdr, sym = end + "IIQQQQIIQQ", end + "IBBHQQ"
    else:
        shoff = struct.unpack_from(end + "I", data, 0x20)[0]
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        shdr, sym = end + "IIIIIIIIII", end + "IIIBBH"
    sections = [struct.unpack_from(shdr, data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for s in sections:
        if s[1] != _SHT_DYNSYM:
            continue
        offset, size, link, entsize = s[4], s[5], s[6], s[9]
        strtab = sections[link][4]
        for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            fields = struct.unpack_from(sym, data, at)
            name, info, other, shndx = (fields[0], fields[1], fields[2], fields[3]) if wide else (
                fields[0], fields[3], fields[4], fields[5])  # fmt: skip
            if shndx == _SHN_UNDEF or info >> 4 == _STB_LOCAL:
                continue
            if other & 3 not in (_STV_DEFAULT, _STV_PROTECTED):
                continue
            stop = data.index(b"\0", strtab + name)
            names.append(data[strtab + name : stop].decode())
    return names


def std_symbols(names: list[str]) -> list[str]:
    return [n for n in names if _STD.match(n)]


def _extension_modules() -> list[Path]:
    spec = importlib.util.find_spec("strata_stream._core")
    if spec is None or spec.origin is None:
        pytest.skip("strata_stream._core is not built")
    folder = Path(spec.origin).parent
    return sorted(p for p in folder.iterdir() if p.name.startswith("_") and ".so" in p.suffixes)


def _elf_modules() -> list[Path]:
    modules = [p for p in _extension_modules() if p.read_bytes()[:4] == b"\x7fELF"]
    if not modules:
        pytest.skip("the extension modules are not ELF (macOS): no ELF symbol table to read")
    return modules


def test_no_extension_module_exports_a_cxx_runtime_symbol() -> None:
    for module in _elf_modules():
        found = std_symbols(exported_symbols(module))
        assert not found, (
            f"{module.name} exports {len(found)} C++ standard library symbols, e.g. "
            f"{found[:5]}: a C++ runtime leaks out of the extension (CMakeLists.txt, "
            "strata_private_runtime)"
        )


def test_every_extension_module_exports_its_init_function_alone() -> None:
    for module in _elf_modules():
        init = "PyInit_" + module.name.split(".")[0]
        names = exported_symbols(module)
        assert init in names, f"{module.name}: {init} not exported"
        extra = sorted(set(names) - {init})
        assert not extra, f"{module.name} exports more than {init}: {extra[:10]} ({len(extra)})"


def test_the_symbol_reader_sees_an_exported_cxx_runtime(tmp_path: Path) -> None:
    """The reader above against a shared object that does export libstdc++ (its default
    visibility and -static-libstdc++, the build that crashed), so the checks can fail."""
    # The toolchain that builds the extension first ($CXX), as the build would use it.
    compiler = next((c for c in (os.environ.get("CXX", ""), "c++", "g++") if c and shutil.which(c)),
                    None)  # fmt: skip
    if compiler is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "leak.cpp"
    src.write_text(
        '#include <sstream>\n#include <string>\nextern "C" int PyInit_leak() { return 0; }\n'
        "std::string format(unsigned long v) { std::ostringstream s; s << v; return s.str(); }\n"
    )
    out = tmp_path / "leak.so"
    build = subprocess.run(
        [compiler, "-shared", "-fPIC", "-static-libstdc++", str(src), "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if build.returncode != 0 or out.read_bytes()[:4] != b"\x7fELF":
        pytest.skip(f"cannot build an ELF shared object with libstdc++ linked statically here: "
                    f"{build.stderr[-300:]}")  # fmt: skip
    names = exported_symbols(out)
    assert "PyInit_leak" in names
    assert "_Z6formatB5cxx11m" in names or any(n.startswith("_Z6formatm") for n in names)
    leaked = std_symbols(names)
    assert any("codecvt" in n for n in leaked), leaked[:10]
    assert "PyInit_leak" not in leaked
