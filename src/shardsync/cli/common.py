"""What several commands share: the mapping from ``--mapping``/``--set``/``--reverse``/``--strict``
and its checks against the source, sizes and dtypes read from flags, progress bars, warnings.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError, MappingError
from ..layout.dtypes import to_torch_dtype
from ..layout.meta import GlobalLayout
from ..mapping import OPTIMIZER_SUFFIXES, SCALAR_SUFFIXES, Mapping, TargetSpec, resolve
from ..mapping.hints import moe_hint
from ..mapping.macros import expand_macros, reverse_program
from ..quant.fp8 import DEFAULT_BLOCK, Block
from ..sizes import parse_size
from ..sources import Source
from ..sources.megatron_config import checkpoint_config
from ..sources.megatron_dist import is_megatron_dist
from .messages import UsageError, printable

__all__ = [
    "MappingFlags",
    "source_dir",
    "command_logging",
    "layout_of",
    "resolve_targets",
    "unconsumed_sources",
    "size_flag",
    "workers_flag",
    "MAX_WORKERS",
    "dtype_flag",
    "parse_sets",
    "progress_bar",
]

log = logging.getLogger(__name__)


def _load_mapping(
    arg: str | None,
    sets: dict[str, str],
    config_dir: Path | None,
    reverse: bool | None,
) -> Mapping | None:
    """The mapping ``--mapping`` names (None: identity): a shipped name, a file, or statements inline.

    The one place the command line turns its mapping flags into a :class:`Mapping`. Parameters come
    from ``--set``, then from the ``config.json`` in ``config_dir`` (or, for a Megatron
    dist_checkpointing directory without one, the arguments its ``common.pt`` keeps). ``--strict``
    is applied by :func:`resolve_targets`, which sees the source keys.

    Raises:
        UsageError: ``--set`` without a mapping that takes parameters.
        MappingError: a missing or unreadable mapping file, or a program with errors.
    """
    if arg is None:
        if sets:
            raise UsageError(
                " ".join(f"--set {k}={v}" for k, v in sets.items())
                + ": the identity mapping (no --mapping) takes no parameters",
                "give --mapping NAME of a shipped mapping, or remove --set",
            )
        return None if reverse is None else Mapping.parse([], reverse=reverse)
    if "->" in arg or "\n" in arg:  # statements given inline
        return Mapping.parse(arg, reverse=reverse, params=sets or None)
    looks_like_path = "/" in arg or "." in arg  # shipped names have neither
    if looks_like_path and not Path(arg).exists():
        raise MappingError(
            f"mapping file {arg!r} does not exist; give the path of a .txt, .json or .yaml "
            "mapping file, a shipped mapping name, or statements such as 'a -> b'"
        )
    # a shipped name (megatron-llama) or a file; parameters from --set win over the config
    return Mapping.parse(
        arg if not Path(arg).exists() else Path(arg),
        reverse=reverse,
        params=sets or None,
        config=_model_config(config_dir),
    )


def _model_config(config_dir: Path | None) -> Path | dict[str, Any] | None:
    """The ``config.json`` in ``config_dir``; else, for a Megatron dist_checkpointing directory, the
    arguments its ``common.pt`` keeps (read without running code from it); else None."""
    if config_dir is None:
        return None
    if (config_dir / "config.json").is_file():
        return config_dir / "config.json"
    if is_megatron_dist(config_dir):
        found = checkpoint_config(config_dir)
        if found is not None:
            log.info(
                "mapping parameters not given by --set come from %s (Megatron's saved args)", config_dir / "common.pt"
            )
        return found
    return None


def source_dir(path: Path) -> Path:
    """The directory of a checkpoint path (where its ``config.json`` would be)."""
    return path if path.is_dir() else path.parent


@dataclass(frozen=True)
class MappingFlags:
    """``--mapping``, ``--reverse``, ``--set`` and ``--strict``, as every command takes them."""

    mapping: str | None = None
    reverse: bool | None = None
    sets: tuple[tuple[str, str], ...] = ()
    strict: bool = False

    def resolve(
        self, layout: GlobalLayout, config_dir: Path | None, fp8_block: Block = DEFAULT_BLOCK
    ) -> tuple[Mapping | None, list[TargetSpec]]:
        """The mapping (parameters from ``--set``, then ``config_dir``'s config.json) and the targets it
        gives over ``layout`` (``fp8_block``: the block of its block-FP8 weights)."""
        mapping = _load_mapping(self.mapping, dict(self.sets), config_dir, self.reverse)
        return mapping, resolve_targets(mapping, layout, strict=self.strict, fp8_block=fp8_block)


def parse_sets(items: Sequence[str] | None) -> dict[str, str]:
    """``--set k=v`` flags as a dict.

    Example:
        >>> parse_sets(["num_heads=32", "tp=2"])
        {'num_heads': '32', 'tp': '2'}
    """
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r} is not key=value", "write e.g. --set num_heads=32")
        out[key.strip()] = value.strip()
    return out


def layout_of(source: Source) -> GlobalLayout:
    """The layout of a source read by one process."""
    return GlobalLayout.merge([source.entries()])


def resolve_targets(
    mapping: Mapping | None, layout: GlobalLayout, *, strict: bool = False, fp8_block: Block = DEFAULT_BLOCK
) -> list[TargetSpec]:
    """Resolve the mapping against a source's layout, with the command line's checks.

    A mapping that does not fit the source as written but does when run the other way is an error
    that says to pass (or drop) ``--reverse``. Sources the mapping leaves unconsumed (they pass
    through under their own names) are a warning, or with ``strict`` an error.

    Raises:
        MappingError: the mapping does not resolve (either way).
        UsageError: it resolves only the other way; with ``strict``, unconsumed sources.
    """
    try:
        targets = resolve(mapping, layout, fp8_block=fp8_block)
    except MappingError as exc:
        if mapping is None or not mapping.statements:
            raise
        try:
            resolve(Mapping(mapping.statements, not mapping.reverse), layout, fp8_block=fp8_block)
        except MappingError:
            raise exc from None
        fix = "pass --reverse" if not mapping.reverse else "drop --reverse (or pass --no-reverse)"
        raise UsageError(
            "the mapping does not fit the source's names as written, but does when run the other way", fix
        ) from exc
    unused = unconsumed_sources(mapping, layout.keys())
    if unused:
        n = len(unused)
        listed = ", ".join(unused[:5]) + (f" and {n - 5} more" if n > 5 else "")
        what = f"no statement consumes {listed if n == 1 else f'{n} sources ({listed})'}"
        moe = moe_hint(unused, mapping) if mapping is not None else None  # dense lines, MoE layers
        if strict:
            raise UsageError(what, moe or "map them, drop them with `NAME -> _`, or leave out --strict")
        passes = "it passes through under its own name" if n == 1 else "they pass through under their own names"
        log.warning("%s: %s (--strict makes this an error)%s", what, passes, f"; {moe}" if moe else "")
    return targets


def unconsumed_sources(mapping: Mapping | None, keys: Sequence[str]) -> list[str]:
    """Source keys that no statement of a (non-empty) mapping reads; they pass through unchanged.
    Optimizer states follow their parameter, so they count as consumed with it.

    Example:
        >>> unconsumed_sources(Mapping.parse(["a -> b"]), ["a", "c", "a.w_0"])
        ['c']
    """
    if mapping is None or not mapping.statements:
        return []
    expanded, _ = expand_macros(mapping.statements, keys, reverse=mapping.reverse)
    if mapping.reverse:
        expanded = reverse_program(expanded)
    used = {n.text for st in expanded for n in st.left}
    suffixes = OPTIMIZER_SUFFIXES + SCALAR_SUFFIXES

    def consumed(key: str) -> bool:
        return key in used or any(key.endswith(s) and key[: -len(s)] in used for s in suffixes)

    return [k for k in keys if not consumed(k)]


def size_flag(value: str | None, flag: str) -> int | None:
    """Bytes in a size flag (``5GB``, ``512MiB``); None when not given.

    Raises:
        UsageError: not a positive size.
    """
    if value is None:
        return None
    try:
        return parse_size(value)
    except FormatError:
        raise UsageError(f"{flag} {value!r} is not a size", "write e.g. 5GB, 500MB or 512MiB") from None


#: Most local workers ``--nproc`` starts (each is a Python process with torch loaded, about 300 MB).
MAX_WORKERS = 256


def workers_flag(value: int) -> int:
    """The number of workers ``--nproc`` gives, checked before anything is read or started.

    Raises:
        UsageError: fewer than 1 or more than :data:`MAX_WORKERS`.

    Example:
        >>> workers_flag(4)
        4
    """
    if not 1 <= value <= MAX_WORKERS:
        raise UsageError(
            f"--nproc {value} is not a number of local workers",
            f"give 1 to {MAX_WORKERS}; for more ranks, start them with torchrun",
        )
    return value


def dtype_flag(value: str | None) -> torch.dtype | None:
    """The floating dtype ``--dtype`` names (bf16, float16...); None when not given.

    Raises:
        UsageError: an unknown or non-floating dtype.
    """
    if value is None:
        return None
    try:
        dtype = to_torch_dtype(value)
    except ValueError:
        dtype = None
    if dtype is None or not dtype.is_floating_point:
        raise UsageError(
            f"--dtype {value!r} is not a floating dtype", "use bf16, fp16, fp32 or a torch name such as bfloat16"
        )
    return dtype


def progress_bar(enabled: bool, desc: str, total: int | None = None) -> Any:
    """A tqdm bar in bytes (rate and ETA) on stderr, or None when disabled or tqdm is missing."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        log.warning("progress bars need tqdm (pip install tqdm)")
        return None
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    )


class _Formatter(logging.Formatter):
    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        return printable(f"shardsync {self.command}: {record.levelname.lower()}: {record.getMessage()}")


@contextlib.contextmanager
def command_logging(command: str, *, quiet: bool = False, debug: bool = False) -> Iterator[None]:
    """While a command runs, shardsync's log records go to stderr as ``shardsync <command>: warning:
    ...`` lines (errors only with ``quiet``; debug records too with ``debug``)."""
    logger = logging.getLogger("shardsync")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(command))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug else logging.ERROR if quiet else logging.WARNING)
    logger.propagate = False
    # the command line says which sources are unconsumed itself (resolve_targets), with its flags
    resolver = logging.getLogger("shardsync.mapping.resolver")
    resolver_level = resolver.level
    resolver.setLevel(logging.ERROR)
    try:
        yield
    finally:
        resolver.setLevel(resolver_level)
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
