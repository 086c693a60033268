"""Human units for everything the command line prints: bytes, rates and durations.

One rule everywhere: decimal units (as HuggingFace and disk vendors count), three significant digits,
the unit chosen so that the number reads naturally ("350 KB", "1.23 GB", never "0.000 GB").
"""

from __future__ import annotations

__all__ = ["human_bytes", "human_rate", "human_seconds"]

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest decimal unit that keeps the number at 1 or more.

    Example:
        >>> human_bytes(0), human_bytes(999), human_bytes(350_000), human_bytes(1_234_567_890)
        ('0 B', '999 B', '350 KB', '1.23 GB')
    """
    value, unit = float(n), 0
    while abs(value) >= 999.5 and unit < len(_UNITS) - 1:
        value /= 1000
        unit += 1
    if unit == 0:
        return f"{int(round(value))} B"
    return f"{_three_digits(value)} {_UNITS[unit]}"


def human_rate(nbytes: float, seconds: float) -> str:
    """Bytes per second, in human units.

    Example:
        >>> human_rate(3_000_000_000, 2.0)
        '1.50 GB/s'
    """
    return human_bytes(nbytes / max(seconds, 1e-9)) + "/s"


def human_seconds(seconds: float) -> str:
    """A duration: seconds with two decimals under a minute, else minutes and seconds.

    Example:
        >>> human_seconds(0.4213), human_seconds(75.2)
        ('0.42 s', '1 min 15 s')
    """
    if seconds < 59.995:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s"


def _three_digits(value: float) -> str:
    if abs(value) >= 99.95:
        return f"{value:.0f}"
    if abs(value) >= 9.995:
        return f"{value:.1f}"
    return f"{value:.2f}"
