"""``save_hf``: write mapped targets as a HuggingFace safetensors checkpoint, every rank writing its
own files in parallel, committed crash-safely by rank 0.

The protocol, on every rank of the group: check the options and the directory (``agree``; nothing is
removed yet) -> stream the targets with ``full_params``, each rank
receiving a contiguous part (``consumers`` = every rank, split by bytes) and handing each file whose
first target it receives to its writer thread as soon as the file is complete -> move the targets of
files that straddle two ranks' parts to their writer -> ``agree`` that every rank wrote its files ->
rank 0 copies the extra files and commits (removes leftovers of killed saves, renames, index last;
:mod:`shardsync.io.commit`) ->
``agree`` on the result.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..dist import GroupRanks, agree, data_phase, group_rank, group_size
from ..errors import PlanError
from ..layout.dtypes import dtype_name, itemsize, to_torch_dtype
from ..mapping import MappingLike
from ..planning import TargetPlan
from ..quant.fp8 import DEFAULT_BLOCK, Fp8Quantize, quantization_config, written
from ..sources.fp8 import dequantized
from ..stream import full_params
from .commit import (CheckpointNames, DirectoryState, commit, new_tag, output_dir, prepare_directory,
                     remove_files, remove_uncommitted)
from .file_plan import FilePlan, output_dtype, plan_files
from .hf_files import copy_files, extra_files
from .safetensors_writer import WriteResult, parse_size, work_dir, write_shard

__all__ = ["save_hf"]

log = logging.getLogger(__name__)
#: Files a rank may have queued for its writer thread before it waits (bounds memory to about this
#: many files plus the one being filled).
FILES_IN_FLIGHT = 2


@dataclass(frozen=True)
class _Job:
    """The checked options, as rank 0 saw them (sent to every rank)."""

    dir: Path
    names: CheckpointNames
    old: DirectoryState
    tag: str
    limit: int
    dtype: torch.dtype | None
    extras: tuple[Path, ...]
    memory_budget: int | None
    fp8: Fp8Quantize | None = None
    cast_unscaled_fp8: bool = False

    def temp(self, file: int) -> Path:
        return self.dir / self.names.temp(self.tag, f"{file + 1:05d}")


def _check(out_dir: str | os.PathLike, max_shard_size: int | str, dtype: Any,
           extras: Iterable[str | os.PathLike] | None, config_from: str | os.PathLike | None,
           overwrite: bool, memory_budget: int | str | None,
           quantize: tuple[Any, Any, Any] = (None, DEFAULT_BLOCK, None), cast_unscaled_fp8: bool = False) -> _Job:
    directory = output_dir(out_dir, "out_dir")
    names = CheckpointNames("model")
    limit = parse_size(max_shard_size)
    budget = None if memory_budget is None else parse_size(memory_budget)
    cast = None if dtype is None else to_torch_dtype(dtype)
    if cast is not None and not cast.is_floating_point:
        raise PlanError(f"dtype={dtype!r} is not a floating dtype; give e.g. torch.bfloat16 or 'bf16'")
    fp8 = Fp8Quantize.of(*quantize)
    files = extra_files(extras, config_from, names)
    old = prepare_directory(directory, names, overwrite)  # leftovers are removed at the commit
    return _Job(directory, names, old, new_tag(old.committed + old.leftovers), limit, cast, files,
                budget, fp8, cast_unscaled_fp8)


class _PartWriter:
    """One rank's share: writes its files as their targets arrive, keeps targets other ranks write."""

    def __init__(self, job: _Job, rank: int, progress: Any) -> None:
        self.job, self.rank, self.bar = job, rank, progress
        self.plan: FilePlan | None = None
        self.targets: tuple[TargetPlan, ...] | None = None  # the stream's targets, once it started
        self.file_of: dict[str, int] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.outgoing: dict[str, torch.Tensor] = {}
        self.written: list[Path] = []
        self.error: BaseException | None = None  # the first failure; the stream is still drained
        # Files are written by a thread, so this rank keeps serving the stream meanwhile (otherwise
        # every rank would wait for each file write in turn).
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardsync-save_hf")
        self.in_flight: deque[Future[None]] = deque()

    def start(self, plan: Any) -> None:
        self.plan = plan_files(plan.targets, self.job.limit, self.job.dtype, self.job.fp8)
        self.targets = tuple(plan.targets)
        self.file_of = self.plan.weight_map()
        if self.bar is not None:
            self.bar.total = sum(math.prod(t.shape) * itemsize(output_dtype(t.dtype, self.job.dtype))
                                 for t in plan.targets if self.rank in t.consumers)

    def take(self, name: str, tensor: torch.Tensor) -> None:
        for n, t in written(name, tensor, self.job.fp8, self.job.dtype):  # quantised: codes, then scales
            self._keep(n, t)

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        assert self.plan is not None
        f = self.file_of[name]
        if self.plan.writers[f] != self.rank:
            self.outgoing[name] = tensor
        else:
            self.pending.setdefault(f, {})[name] = tensor.detach().cpu()
            if len(self.pending[f]) == len(self.plan.files[f]):
                self.write(f)
        if self.bar is not None:
            self.bar.update(tensor.numel() * tensor.element_size())

    def write(self, f: int) -> None:
        assert self.plan is not None
        tensors = self.pending.pop(f, {})
        if self.error is not None:
            return
        missing = set(self.plan.files[f]) - set(tensors)
        if missing:
            raise RuntimeError(f"file {f + 1}: targets {sorted(missing)} never arrived")
        self.written.append(self.job.temp(f))
        while len(self.in_flight) >= FILES_IN_FLIGHT:
            self._wait_oldest()
        self.in_flight.append(self.pool.submit(write_shard, self.job.temp(f), tensors, {"format": "pt"}))

    def _wait_oldest(self) -> None:
        error = self.in_flight.popleft().exception()
        self.error = self.error or error

    def finish(self) -> None:
        """Write the files still open (those that waited for moved targets, an empty checkpoint)."""
        assert self.plan is not None
        done = {p.name for p in self.written}
        for f in self.plan.files_of(self.rank):
            if self.job.temp(f).name not in done:
                self.write(f)
        self.close()

    def close(self) -> None:
        """Wait for the files being written."""
        while self.in_flight:
            self._wait_oldest()
        self.pool.shutdown()


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(part: _PartWriter, group: Any) -> None:
    """Send targets to the writers of their files (point to point; only boundary files need it)."""
    assert part.plan is not None
    ranks = GroupRanks.of(group)
    ops, incoming = [], {}
    for m in part.plan.moves:
        if m.src == part.rank:
            # a target this rank failed to take is sent as zeros so that the writer is not left
            # waiting; the save fails in the next phase anyway
            tensor = part.outgoing.pop(m.name, None)
            if tensor is None:
                tensor = torch.zeros(m.shape, dtype=to_torch_dtype(m.dtype), device=_device(group))
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), ranks.to_global(m.dst), group))
        elif m.dst == part.rank:
            incoming[m.name] = torch.empty(m.shape, dtype=to_torch_dtype(m.dtype), device=_device(group))
            ops.append(dist.P2POp(dist.irecv, incoming[m.name], ranks.to_global(m.src), group))
    with data_phase("save_hf: move targets to their file's writer", group):
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    for name, tensor in incoming.items():
        f = part.file_of[name]
        part.pending.setdefault(f, {})[name] = tensor.cpu()


def _write_part(part: _PartWriter, source: Any, mapping: MappingLike | None, group: Any) -> None:
    world = group_size(group)
    if part.job.dtype is not None:  # a dtype asks for values: block-FP8 weights are dequantised
        source = dequantized(source, unscaled="cast" if part.job.cast_unscaled_fp8 else "error")
    stream = full_params(source, mapping, group=group, copy=False, split_by="bytes",
                         consumers=tuple(range(world)) if world > 1 else "all",
                         memory_budget=part.job.memory_budget)
    for name, tensor in stream:
        try:
            if part.plan is None:
                part.start(stream.plan)
            part.take(name, tensor)
        except Exception as exc:  # reported in the next phase; this rank keeps serving the stream
            part.error = part.error or exc
    try:
        if part.plan is None:  # this rank received nothing
            part.start(stream.plan)
        if world > 1:
            _exchange(part, group)
        part.finish()
    except Exception as exc:
        part.error = part.error or exc


def _quantization(job: _Job, targets: Iterable[TargetPlan]) -> dict[str, Any] | None | Literal["keep"]:
    """``config.json``'s new ``quantization_config``: block FP8 when quantising (naming the modules
    whose 2-D weights stay unquantised: the output head, routers), none when a dtype was asked for (the
    weights are values), else as it was."""
    if job.fp8 is not None:
        fp8 = job.fp8
        skipped = [t.name.removesuffix(".weight") for t in targets if t.name.endswith(".weight")
                   and len(t.shape) == 2 and not fp8.selects(t.name, t.shape, t.dtype)]
        return quantization_config(fp8.block, skipped)
    return None if job.dtype is not None else "keep"


def _commit(job: _Job, plan: FilePlan, quantization: dict[str, Any] | None | Literal["keep"]) -> WriteResult:
    try:
        copy_files(job.extras, job.dir, job.names, job.tag,
                   None if job.dtype is None else dtype_name(job.dtype), quantization)
        temps = [job.temp(f) for f in range(len(plan.files))]
        files, index = commit(job.dir, job.names, temps, plan.weight_map(), plan.total_bytes, job.old,
                              job.tag)
    except BaseException:
        remove_uncommitted(job.dir, job.names)
        raise
    return WriteResult(files, index, sum(len(f) for f in plan.files), plan.total_bytes)


def _progress_bar(enabled: bool, rank: int) -> Any:
    if not enabled or rank != 0:
        return None
    try:
        from tqdm import tqdm  # optional: the "cli" extra
    except ImportError:
        log.warning("progress=True needs tqdm (pip install tqdm); writing without a progress bar")
        return None
    return tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc="save_hf", file=sys.stderr)


def save_hf(source: Any, out_dir: str | os.PathLike, mapping: MappingLike | None = None, *,
            group: Any = None, max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None,
            extra_files: Iterable[str | os.PathLike] | None = None,
            config_from: str | os.PathLike | None = None, overwrite: bool = False,
            progress: bool = False, memory_budget: int | str | None = None,
            quantize: Literal["fp8"] | None = None, quantize_block: tuple[int, int] = DEFAULT_BLOCK,
            quantize_patterns: Iterable[str] | None = None, cast_unscaled_fp8: bool = False) -> WriteResult:
    """Write ``source``, mapped, as a HuggingFace safetensors checkpoint; call on every rank.

    Every rank writes the files whose tensors it receives, in parallel; rank 0 writes the index last,
    after every rank has written its files. The files and index do not depend on the number of ranks.
    A failure on any rank raises on every rank and leaves the directory as it was.

    Args:
        source: what :func:`shardsync.full_params` streams from (this rank's state dict).
        out_dir: the checkpoint directory (created if missing; on a file system every rank shares).
        mapping: None (every source is a target) or a mapping program.
        group: process group; None: the default group when torch.distributed is up, else one process.
        max_shard_size: most bytes per file, as HuggingFace reads it (``"5GB"``, ``"500MB"``, an int);
            a larger tensor gets a file of its own.
        dtype: cast floating targets to this dtype (``torch.bfloat16``, ``"bf16"``); block-FP8 weights
            of the source are dequantised first, and their scales are not written (docs/fp8.md).
        extra_files: paths copied into ``out_dir`` as they are (``config.json``, tokenizer files).
        config_from: a model directory whose ``config.json``, ``generation_config.json`` and tokenizer
            files are copied, so that ``from_pretrained(out_dir)`` works as it is. Without it (and
            without a ``config.json`` among ``extra_files``) a warning says that it will not.
        overwrite: replace a checkpoint already in ``out_dir`` (other files there are never touched).
        progress: a progress bar (bytes, rate, ETA) on rank 0; needs tqdm.
        memory_budget: most bytes the streamer holds at once on any rank (int or ``"2GB"``).
        quantize: ``"fp8"``: write the selected targets as block FP8, codes (``float8_e4m3fn``) and
            ``<name>_scale_inv`` (fp32, ``amax / 448`` per block), and give ``config.json`` the matching
            ``quantization_config``.
        quantize_block: rows x columns of a block.
        quantize_patterns: regular expressions of the targets to quantise; None: the Linear weights.
        cast_unscaled_fp8: with ``dtype``, cast FP8 tensors that have no scales as if their codes were
            values (otherwise an error naming them).

    Returns:
        the committed files and totals (the same on every rank).

    Raises:
        FormatError: ``out_dir`` holds a checkpoint (and not ``overwrite``), bad sizes or extra files.
        ValueError: a non-floating ``dtype``; (PlanError) bad ``quantize`` options.
        LayoutError: with ``dtype``, FP8 tensors without scales, or scales that do not fit their weight.
        DistributedError: a rank failed (raised on every rank, naming it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_hf({"w": torch.ones(2, 3)}, d, dtype="bf16").files[0].name
        'model.safetensors'
    """
    rank = group_rank(group)
    quantize_args = (quantize, quantize_block, None if quantize_patterns is None else tuple(quantize_patterns))
    job = agree("save_hf: check options", lambda: _check(out_dir, max_shard_size, dtype, extra_files,
                                                           config_from, overwrite, memory_budget,
                                                           quantize=quantize_args,
                                                           cast_unscaled_fp8=cast_unscaled_fp8),
                group, unanimous=True).all[0]
    part = _PartWriter(job, rank, _progress_bar(progress, rank))
    try:
        _write_part(part, source, mapping, group)
        agree("save_hf: write files", lambda: _raise(part.error), group)
    except BaseException:
        part.close()
        remove_files(job.dir, [name for p in part.written for name in (p.name, work_dir(p).name)])
        raise
    finally:
        if part.bar is not None:
            part.bar.close()
    plan = part.plan
    assert plan is not None and part.targets is not None
    quantization = _quantization(job, part.targets)
    result = agree("save_hf: commit", lambda: _commit(job, plan, quantization) if rank == 0 else None,
                   group).all[0]
    assert result is not None  # rank 0's result, sent to every rank
    if rank == 0 and not any(f.name == "config.json" for f in job.extras):
        log.warning("save_hf: %s has no config.json, so from_pretrained will not load it; pass "
                    "config_from=<the model's directory> (command line: --config-from DIR)", job.dir)
    return result


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
