"""Byte sizes as people write them (``80GiB``, ``141GB``) and as the planner prints them."""

from __future__ import annotations

import re

__all__ = ["GiB", "format_bytes", "parse_bytes", "parse_flag_bytes"]

GiB = 1 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> bytes; accepts B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 141GB, 1TiB or 512MiB")
    value = float(match.group(1))
    if not unit and value:  # "80" would be 80 bytes: almost surely meant as GiB or GB
        raise ValueError(f"{text!r} has no unit (it would be {value:g} bytes); write e.g. {value:g}GiB or {value:g}B")
    return int(value * _UNITS[unit])


def parse_flag_bytes(name: str, text: str) -> int:
    """:func:`parse_bytes` for the flag ``--name`` (underscores as dashes): its ValueError names the flag."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise ValueError(f"--{name.replace('_', '-')}: {error}") from None


def format_bytes(value: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{value / GiB:.2f} GiB"
