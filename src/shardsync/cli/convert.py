"""``shardsync convert`` (and its alias ``export``): any checkpoint to HF safetensors or torch DCP.

The protocol: open the source and resolve the mapping against its layout (headers only; a bad path or
mapping fails here, before anything is read) -> check the output -> with ``--nproc N``, start N workers
through torch's launcher, each running the rest on its part -> write with the library's savers
(:func:`~shardsync.save_hf`, :func:`~shardsync.save_dcp`), the same calls as the API.

Memory: ``--to hf`` holds what the streamer holds (at most ``--memory-budget``) plus the files being
written (about three files of ``--max-shard-size``); ``--to dcp`` holds each worker's share of the
targets until torch's DCP writer has written them (about the total divided by ``--nproc``), and
``--memory-budget`` bounds that share plus the streamer.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ..dist import group_rank, group_size
from ..io.commit import CheckpointNames, scan
from ..io.save_dcp import save_dcp
from ..io.save_hf import save_hf
from ..layout.dtypes import itemsize, to_torch_dtype
from ..mapping import Mapping, TargetSpec
from ..planning import split_ranges
from ..quant.fp8 import DEFAULT_BLOCK
from ..sources import Source, dequantized, open_source
from ..sources.dcp import METADATA_FILE
from ..sources.fp8 import fp8_block
from ..sources.select import select_keys
from .common import MappingFlags, layout_of, source_dir
from .messages import UsageError
from .units import human_bytes, human_rate, human_seconds

__all__ = ["ConvertConfig", "Converted", "run_convert", "prepare", "write"]


@dataclass(frozen=True)
class ConvertConfig:
    """``shardsync convert`` with its flags checked (sizes in bytes, dtype resolved)."""

    source: Path
    out: Path
    flags: MappingFlags = MappingFlags()
    to: Literal["hf", "dcp"] = "hf"
    dtype: torch.dtype | None = None
    max_shard_size: int | None = None
    memory_budget: int | None = None
    nproc: int = 1
    config_from: Path | None = None
    overwrite: bool = False
    progress: bool = True
    prefix: str = ""
    keys: tuple[str, ...] = ()
    quantize: Literal["fp8"] | None = None
    quantize_block: tuple[int, int] = DEFAULT_BLOCK
    cast_unscaled_fp8: bool = False


@dataclass(frozen=True)
class Converted:
    """What a conversion wrote: tensors, bytes, files, and how long it took."""

    tensors: int
    nbytes: int
    files: int
    seconds: float
    workers: int

    def summary(self, out: Path) -> str:
        """The line ``convert`` prints.

        Example:
            >>> print(Converted(4, 350_000, 1, 0.5, 1).summary(Path("hf")))
            wrote 4 tensors (350 KB) in 1 file to hf in 0.50 s (700 KB/s)
        """
        workers = f" with {self.workers} workers" if self.workers > 1 else ""
        return (
            f"wrote {self.tensors} tensors ({human_bytes(self.nbytes)}) in {self.files} file"
            f"{'s' if self.files != 1 else ''} to {out} in {human_seconds(self.seconds)}{workers} "
            f"({human_rate(self.nbytes, self.seconds)})"
        )


@dataclass(frozen=True)
class _Prepared:
    source: Source
    mapping: Mapping | None
    targets: list[TargetSpec]
    config_from: Path | None


def prepare(cfg: ConvertConfig) -> _Prepared:
    """Open the source, resolve the mapping and check the flags and the output (reads headers only).

    Raises:
        UsageError: flags that do not go together, an output that exists without ``--overwrite``.
        FormatError: the source is not a checkpoint.
        MappingError: the mapping is wrong.
    """
    if cfg.to == "dcp" and (cfg.max_shard_size is not None or cfg.config_from is not None):
        flag = "--max-shard-size" if cfg.max_shard_size is not None else "--config-from"
        raise UsageError(f"{flag} applies to --to hf only", f"drop {flag}, or write --to hf")
    source = select_keys(open_source(cfg.source), cfg.prefix, cfg.keys)
    if cfg.dtype is not None:  # a dtype asks for values: block-FP8 weights are dequantised
        source = dequantized(source, unscaled="cast" if cfg.cast_unscaled_fp8 else "error")
    mapping, targets = cfg.flags.resolve(
        layout_of(source), cfg.config_from or source_dir(cfg.source), fp8_block(source)
    )
    config_from = cfg.config_from
    if cfg.to == "hf" and config_from is None and mapping is None:
        # same names, same model: its config.json and tokenizer files belong with the weights
        here = source_dir(cfg.source)
        config_from = here if (here / "config.json").is_file() else None
    _check_output(cfg)
    if cfg.to == "dcp":
        _stream_budget(cfg, targets, cfg.nproc)  # fails here, before any worker starts
    return _Prepared(source, mapping, targets, config_from)


def _check_output(cfg: ConvertConfig) -> None:
    """The writers check the output again; checking here fails before any worker starts."""
    if cfg.out.exists() and not cfg.out.is_dir():
        raise UsageError(f"{cfg.out} is a file, not a directory", "choose a directory for the checkpoint")
    if cfg.out.resolve() == source_dir(cfg.source).resolve():
        raise UsageError(
            f"{cfg.out} is the directory of the source {cfg.source}: the output would replace the files being read",
            "write to another directory",
        )
    if cfg.overwrite:
        return
    if cfg.to == "dcp" and (cfg.out / METADATA_FILE).exists():
        raise UsageError(
            f"{cfg.out} already holds a DCP checkpoint", "pass --overwrite to replace it, or choose another directory"
        )
    committed = scan(cfg.out, CheckpointNames()).committed if cfg.to == "hf" else ()
    if committed:
        raise UsageError(
            f"{cfg.out} already holds a checkpoint ({committed[0]})",
            "pass --overwrite to replace it, or choose another directory",
        )


def run_convert(cfg: ConvertConfig) -> Converted:
    """Convert in this process, or with ``cfg.nproc`` workers started through torch's launcher
    (forked from the ``shardsync`` command, which then runs torch on one thread itself: see
    :mod:`shardsync.cli.launch`).

    A conversion that fails leaves no directory it created behind (the writers remove their files).
    """
    start = time.perf_counter()
    if cfg.nproc > 1:
        from . import launch  # local: it imports this module

        if launch.start_method() == "fork":
            launch.pin_threads()  # before opening the source can run a parallel op
    prepared = prepare(cfg)
    created = _missing_dirs(cfg.out)
    try:
        if cfg.nproc > 1:
            results = launch.launch(cfg, cfg.nproc)
            return replace(results[0], seconds=time.perf_counter() - start, workers=cfg.nproc)
        done = write(cfg, prepared, group=None)
    except BaseException:
        for d in created:  # deepest first; a directory something else wrote into stays
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return replace(done, seconds=time.perf_counter() - start)


def _missing_dirs(out: Path) -> list[Path]:
    """``out`` and each of its parents that does not exist yet, deepest first."""
    missing, here = [], out.absolute()
    for d in (here, *here.parents):
        if os.path.lexists(d):
            break
        missing.append(d)
    return missing


def write(cfg: ConvertConfig, prepared: _Prepared, group: Any) -> Converted:
    """Stream and write on every rank of ``group`` (None: this process alone)."""
    start = time.perf_counter()
    progress = cfg.progress and group_rank(group) == 0
    if cfg.to == "hf":
        result = save_hf(
            prepared.source,
            cfg.out,
            prepared.mapping,
            group=group,
            max_file_size=cfg.max_shard_size or "5GB",
            dtype=cfg.dtype,
            config_from=prepared.config_from,
            overwrite=cfg.overwrite,
            progress=progress,
            memory_budget=cfg.memory_budget,
            quantize=cfg.quantize,
            quantize_block=cfg.quantize_block,
            cast_unscaled_fp8=cfg.cast_unscaled_fp8,
        )
        return Converted(
            result.num_tensors, result.total_bytes, len(result.files), time.perf_counter() - start, group_size(group)
        )
    return _write_dcp(cfg, prepared, group, progress, start)


def _out_bytes(t: TargetSpec, dtype: torch.dtype | None) -> int:
    floating = to_torch_dtype(t.dtype).is_floating_point
    size = itemsize(dtype) if dtype is not None and floating else itemsize(t.dtype)
    return math.prod(t.shape) * size


def _dcp_shares(targets: list[TargetSpec], world: int, dtype: torch.dtype | None) -> list[int]:
    """Bytes of targets each of ``world`` workers holds under ``--to dcp`` (the stream's split)."""
    parts = split_ranges([t.nbytes for t in targets], world, "bytes")
    return [sum(_out_bytes(targets[i], dtype) for i in part) for part in parts]


def _stream_budget(cfg: ConvertConfig, targets: list[TargetSpec], world: int) -> int | None:
    """The streamer's budget under ``--to dcp``: what ``--memory-budget`` leaves after the share of
    targets a worker holds until DCP writes them, which must still fit the largest target.

    Raises:
        UsageError: it does not (with the number of workers that would fit, if there is one).
    """
    if cfg.memory_budget is None:
        return None
    largest = max((t.nbytes for t in targets), default=0)
    share = max(_dcp_shares(targets, world, cfg.dtype), default=0)
    if cfg.memory_budget - share >= largest:
        return cfg.memory_budget - share
    fits = next(
        (
            w
            for w in range(world + 1, len(targets) + 1)
            if max(_dcp_shares(targets, w, cfg.dtype)) + largest <= cfg.memory_budget
        ),
        None,
    )
    more = f"use --nproc {fits} or more, " if fits is not None else ""
    raise UsageError(
        f"--to dcp holds each worker's share of the targets until it is written (up to "
        f"{human_bytes(share)}), which leaves less of --memory-budget "
        f"{human_bytes(cfg.memory_budget)} than the largest target ({human_bytes(largest)}) "
        "to read and build them",
        f"{more}raise --memory-budget, or write --to hf",
    )


def _write_dcp(cfg: ConvertConfig, prepared: _Prepared, group: Any, progress: bool, start: float) -> Converted:
    world = group_size(group)
    metadata = save_dcp(
        prepared.source,
        cfg.out,
        prepared.mapping,
        group=group,
        dtype=cfg.dtype,
        overwrite=cfg.overwrite,
        progress=progress,
        memory_budget=_stream_budget(cfg, prepared.targets, world),
        quantize=cfg.quantize,
        quantize_block=cfg.quantize_block,
        cast_unscaled_fp8=cfg.cast_unscaled_fp8,
    )
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    nbytes = sum(_out_bytes(t, cfg.dtype) for t in prepared.targets)
    return Converted(len(prepared.targets), nbytes, len(files), time.perf_counter() - start, world)
