"""Sizes in bytes, as every API argument and command-line flag takes them: ``7``, ``"5GB"``, ``"512MiB"``.

The one parser of sizes: ``memory_budget``, ``bucket_bytes`` and ``mesh_threshold_bytes`` of the
streaming, load and save functions, ``max_shard_size`` of the writers, and the CLI's size flags all
read a size through :func:`parse_size`, so a size that one of them accepts every other one accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from .errors import FormatError

__all__ = ["SIZE_OPTIONS", "parse_size", "sizes_in"]

#: Decimal units (as HuggingFace and disk vendors count) and binary ones; no unit means bytes.
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*")
_HINT = "write e.g. '5GB', '500MB' or '512MiB'"

#: The options of the streaming and load functions that are sizes in bytes.
SIZE_OPTIONS = ("bucket_bytes", "memory_budget", "mesh_threshold_bytes")


def parse_size(size: int | str, name: str | None = None) -> int:
    """Bytes in ``size``: a positive int, or a string like ``"5GB"`` (decimal units, as HuggingFace
    uses), ``"512MiB"`` (binary units) or ``"4096"`` (bytes).

    Args:
        size: the size.
        name: what the size is for, as errors name it (``"memory_budget"``); None: unnamed.

    Raises:
        FormatError: not a positive size.

    Example:
        >>> parse_size("5GB"), parse_size("1.5KiB"), parse_size(7), parse_size("64MiB")
        (5000000000, 1536, 7, 67108864)
    """
    of = "" if name is None else f" for {name}"
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.fullmatch(size.upper()) if isinstance(size, str) else None
        if m is None:
            raise FormatError(f"cannot read size {size!r}{of}; {_HINT}")
        value = int(Fraction(m.group(1)) * _UNITS[m.group(2) or ""])
    if value < 1:
        raise FormatError(f"size {size!r}{of} is not positive; {_HINT}")
    return value


def sizes_in(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with each size given as a string (one of :data:`SIZE_OPTIONS`) in bytes; the other
    values are left for the options' own checks, which report every bad one at once.

    Raises:
        FormatError: a size string :func:`parse_size` cannot read.

    Example:
        >>> sizes_in({"memory_budget": "64MiB", "bucket_bytes": 4096, "copy": True})
        {'memory_budget': 67108864, 'bucket_bytes': 4096, 'copy': True}
    """
    return {k: parse_size(v, k) if k in SIZE_OPTIONS and isinstance(v, str) else v for k, v in options.items()}
