"""The MSL subset the kernels may use, and a lint that rejects anything outside it.

The Linux emulator (tests/metal/shim/) models exactly this subset. A builtin it does not model
(simd_shuffle, threadgroup memory, textures, fast:: math, vector types...) would either fail to
compile there or, worse, compile against a C/C++ library function with different semantics.
So every identifier in the kernel sources must be a keyword or builtin listed here, or be
defined by the kernel sources themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

KEYWORDS = {
    "auto",
    "bool",
    "break",
    "case",
    "const",
    "constexpr",
    "continue",
    "default",
    "device",
    "constant",
    "thread",
    "else",
    "enum",
    "false",
    "for",
    "if",
    "inline",
    "return",
    "static",
    "struct",
    "switch",
    "template",
    "true",
    "typename",
    "class",
    "using",
    "namespace",
    "void",
    "while",
    "nullptr",
    "sizeof",
    "static_assert",
    "defined",
    "include",
    "pragma",
    "once",
    "ifdef",
    "ifndef",
    "endif",
    "define",
    "elif",
    "undef",
}
TYPES = {"float", "int", "uint", "ushort", "uchar", "ulong", "half", "uint3", "atomic_uint"}
BUILTINS = {
    "simd_sum",
    "threadgroup_barrier",
    "mem_flags",
    "mem_device",
    "mem_threadgroup",
    "mem_none",
    "fma",
    "exp",
    "min",
    "max",
    "clamp",
    "as_type",
    "atomic_load_explicit",
    "atomic_store_explicit",
    "memory_order_relaxed",
    "x",
    "y",
    "z",  # uint3 members
    "metal",
    "metal_stdlib",
    "__METAL_VERSION__",
    "__VA_ARGS__",
    "__COUNTER__",
    "STRATA_MSL_TYPECHECK",
}
ATTRIBUTES = {
    "kernel",
    "host_name",
    "buffer",
    "threadgroup_position_in_grid",
    "thread_position_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
}
# Named outright so the error says why, even if a kernel source happened to define the name.
FORBIDDEN = re.compile(
    r"\b(threadgroup|simd_shuffle\w*|simd_broadcast\w*|simd_prefix\w*|simd_(?:max|min|product|"
    r"and|or|xor|all|any|ballot)|quad_\w+|simdgroup_\w*matrix\w*|texture\w*|sampler|"
    r"atomic_fetch\w*|atomic_exchange\w*|atomic_compare\w*|fast|precise|std)\b(?!_)"
)

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_NUMBER = re.compile(r"\b\d[\w.]*")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_CONDITION = re.compile(r"#\s*(ifdef|ifndef|if|elif)\s+(?:defined\s*\(\s*)?(\w+)")


def metal_view(text: str) -> str:
    """The lines the Metal compiler sees: __METAL_VERSION__ defined, every other macro tested
    by #if/#ifdef (the shim's and the host's) undefined."""
    kept: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (this branch active, some branch already taken)
    for line in text.splitlines():
        active = all(a for a, _ in stack)
        m = _CONDITION.match(line.strip())
        word = (
            line.strip().lstrip("#").strip().split(" ")[0] if line.strip().startswith("#") else ""
        )
        if m and m.group(1) in ("ifdef", "ifndef", "if"):
            truth = m.group(2) == "__METAL_VERSION__"
            truth = not truth if m.group(1) == "ifndef" else truth
            stack.append((truth, truth))
        elif m and m.group(1) == "elif":
            truth = m.group(2) == "__METAL_VERSION__" and not stack[-1][1]
            stack[-1] = (truth, stack[-1][1] or truth)
        elif word == "else":
            stack[-1] = (not stack[-1][1], True)
        elif word == "endif":
            stack.pop()
        elif active:
            kept.append(line)
    return "\n".join(kept)


def _clean(text: str) -> str:
    text = _STRING.sub('""', _COMMENT.sub(" ", text))
    return _NUMBER.sub(" ", metal_view(text.replace("\\\n", " ")))


def _defined(text: str) -> set[str]:
    names: set[str] = set()
    for m in re.finditer(r"#\s*define\s+(\w+)(?:\(([^)]*)\))?", text):
        names.add(m.group(1))
        names.update(_IDENT.findall(m.group(2) or ""))
    names.update(re.findall(r"\b(?:struct|class|typename)\s+(\w+)", text))
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", text):
        names.update(re.findall(r"(\w+)\s*(?:=|,|$)", body))
    names.update(re.findall(r"\benum\s+(\w+)", text))
    return names


def _declared(text: str, types: set[str]) -> set[str]:
    # A name right after a type (with const, address space, *, & around it) is declared here:
    # variables, parameters, members and functions.
    type_alt = "|".join(sorted(types, key=len, reverse=True))
    pat = re.compile(
        rf"\b(?:{type_alt})\b(?:\s*<[^;(){{}}]*>)?(?:\s+const)?\s*[*&]*\s*(?:const\s+)?"
        rf"(\w+(?:\s*,\s*(?!(?:{type_alt}|const|device|constant|thread)\b)\w+)*)"
    )
    return {name for names in pat.findall(text) for name in _IDENT.findall(names)}


def violations(sources: dict[str, str]) -> list[str]:
    """Problems in the given kernel sources (name -> text); empty when all are in the subset."""
    cleaned = {name: _clean(text) for name, text in sources.items()}
    every = "\n".join(cleaned.values())
    defined = _defined(every)
    types = TYPES | defined | {"void", "bool", "STRATA_U32", "STRATA_U64"}
    defined |= _declared(every, types)
    allowed = KEYWORDS | TYPES | BUILTINS | ATTRIBUTES | defined
    problems = []
    for name, text in cleaned.items():
        for m in FORBIDDEN.finditer(text):
            problems.append(f"{name}: '{m.group(1)}' is outside the MSL subset the shim models")
        for attr in re.findall(r"\[\[\s*(\w+)", text):
            if attr not in ATTRIBUTES:
                problems.append(f"{name}: attribute [[{attr}]] is outside the subset")
        for ident in sorted(set(_IDENT.findall(text)) - allowed):
            problems.append(f"{name}: '{ident}' is neither defined here nor an allowed builtin")
    return problems


def kernel_sources(kernels: Path) -> dict[str, str]:
    files = sorted([*kernels.glob("*.metal"), *kernels.glob("*.h")])
    return {f.name: f.read_text() for f in files}
