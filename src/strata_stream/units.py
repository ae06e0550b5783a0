"""Byte counts for people: the unit scaled to the number (a tiny model reads KiB, not 0.000 GB)."""

from __future__ import annotations

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit it reaches, three significant digits or more:
    ``human_bytes(3 << 30) == "3.00 GiB"``, ``human_bytes(1536) == "1.50 KiB"``,
    ``human_bytes(12) == "12 bytes"``."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.{2 if abs(value) < 10 else 1 if abs(value) < 100 else 0}f} {unit}"
    return f"{n:.0f} bytes"
