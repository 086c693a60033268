"""``save_hf``: write mapped targets as a HuggingFace safetensors checkpoint, every rank writing its
own files in parallel, committed crash-safely by rank 0.

The protocol, on every rank of the group: check the options and the directory (``agree``; nothing is
removed yet) -> the orchestrator (:mod:`shardsync.pipeline`) into :class:`Files`, the destination
"files": the plan packs the targets into files (independent of the number of ranks), gives each file
a writer (contiguous runs of files, balanced by bytes) and makes that writer the consumer of every
target of the file, so each rank receives exactly the targets of its own files and hands each target
to its writer thread as it arrives, which writes it at its offset in its file
(:mod:`shardsync.io.rank_files`) -> ``agree`` that every rank wrote its files -> rank 0
copies the extra files and commits (removes leftovers of killed saves, renames, index last;
:mod:`shardsync.io.commit`) -> ``agree`` on the result.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from .. import phases
from ..dist import abandon, agree, group_rank, group_size
from ..errors import PlanError, ShardsyncError
from ..exec import Stats
from ..layout import GlobalLayout
from ..layout.dtypes import dtype_name, itemsize
from ..layout.meta import LayoutEntry
from ..mapping import Mapping, MappingLike
from ..options import Options
from ..pipeline import Call, Planned, Prepared, resolve_checked, run
from ..planning import PlanOptions, TargetPlan, build_plan
from ..planning.mesh import Topology
from ..quant.fp8 import DEFAULT_BLOCK, Block, Fp8Quantize, quantization_config, written
from ..sources import Source, SourceLike
from ..sources.fp8 import dequantized
from .commit import (
    CheckpointNames,
    DirectoryState,
    commit,
    new_tag,
    output_dir,
    prepare_directory,
    remove_uncommitted,
)
from .file_plan import FilePlan, file_owners, output_cast, output_dtype, plan_files, written_tensors
from .hf_files import copy_files, extra_files
from .rank_files import FileWriter, in_flight
from .safetensors_file import TensorSpec, header
from .safetensors_writer import WriteResult, parse_size

__all__ = ["save_hf", "Files", "progress_bar"]

log = logging.getLogger(__name__)
#: Every file's header metadata (as transformers writes it).
METADATA = {"format": "pt"}


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
    fp8: Fp8Quantize | None = None
    cast_unscaled_fp8: bool = False

    def temp(self, file: int) -> Path:
        return self.dir / self.names.temp(self.tag, f"{file + 1:05d}")


def _check(
    out: str | os.PathLike,
    max_file_size: int | str,
    dtype: Any,
    extras: Iterable[str | os.PathLike] | None,
    config_from: str | os.PathLike | None,
    overwrite: bool,
    fp8: Fp8Quantize | None = None,
    cast_unscaled_fp8: bool = False,
) -> _Job:
    directory = output_dir(out, "path")
    names = CheckpointNames("model")
    limit = parse_size(max_file_size)
    cast = output_cast(dtype)
    files = extra_files(extras, config_from, names)
    old = prepare_directory(directory, names, overwrite)  # leftovers are removed at the commit
    return _Job(
        directory, names, old, new_tag(old.committed + old.leftovers), limit, cast, files, fp8, cast_unscaled_fp8
    )


class _PartWriter:
    """One rank's share: hands each tensor of its files to the writer thread as it arrives (it
    receives only those); a file is opened at its first tensor and closed (fsynced) at its last."""

    def __init__(self, job: _Job, rank: int, progress: Any, budget: int | None = None) -> None:
        self.job, self.rank, self.bar = job, rank, progress
        self.plan: FilePlan | None = None
        self.targets: tuple[TargetPlan, ...] | None = None  # the stream's targets, once it started
        self.file_of: dict[str, int] = {}
        self.specs: dict[str, TensorSpec] = {}
        self.left: dict[int, int] = {}  # an opened file -> its tensors not handed over yet
        self.error: BaseException | None = None  # the first failure; the stream is still drained
        self.writer = FileWriter(in_flight(budget))  # a memory budget bounds the writer too

    def start(self, plan: Any) -> None:
        job = self.job
        self.plan = plan_files(plan.targets, job.limit, job.dtype, job.fp8)
        self.targets = tuple(plan.targets)
        self.file_of = self.plan.weight_map()
        written_as = written_tensors(plan.targets, job.dtype, job.fp8)
        self.specs = {w.name: TensorSpec(w.name, w.dtype, w.shape) for w in written_as}
        for names in self.plan.files:  # what cannot be written is refused on every rank, before data moves
            header([self.specs[n] for n in names], METADATA)
        if self.bar is not None:
            self.bar.total = sum(
                math.prod(t.shape) * itemsize(output_dtype(t.dtype, job.dtype))
                for t in plan.targets
                if self.rank in t.consumers
            )

    def take(self, name: str, tensor: torch.Tensor) -> None:
        for n, t in written(name, tensor, self.job.fp8, self.job.dtype):  # quantised: codes, then scales
            f = self.file_of[n]
            self._open(f)
            self.left[f] -= 1
            self.writer.write(f, n, t)
            if self.left[f] == 0:
                self.writer.close(f)
            if self.bar is not None:
                self.bar.update(t.numel() * t.element_size())

    def _open(self, f: int) -> None:
        if f not in self.left:
            assert self.plan is not None
            names = self.plan.files[f]
            self.writer.open(f, self.job.temp(f), [self.specs[n] for n in names], METADATA)
            self.left[f] = len(names)

    def finish(self) -> None:
        """Write the files still open (an empty checkpoint's one file) and wait for the writer."""
        assert self.plan is not None
        for f in self.plan.files_of(self.rank):
            if f not in self.left and not self.plan.files[f]:
                self._open(f)
                self.writer.close(f)
        short = [f"file {f + 1}" for f in self.plan.files_of(self.rank) if self.left.get(f, 1)]
        if short and self.error is None:
            raise RuntimeError(f"{', '.join(short)}: some of their targets never arrived")
        self.writer.finish()


def _quantization(job: _Job, targets: Iterable[TargetPlan]) -> dict[str, Any] | None | Literal["keep"]:
    """``config.json``'s new ``quantization_config``: block FP8 when quantising (naming the modules
    whose 2-D weights stay unquantised: the output head, routers), none when a dtype was asked for (the
    weights are values), else as it was."""
    if job.fp8 is not None:
        fp8 = job.fp8
        skipped = [
            t.name.removesuffix(".weight")
            for t in targets
            if t.name.endswith(".weight") and len(t.shape) == 2 and not fp8.selects(t.name, t.shape, t.dtype)
        ]
        return quantization_config(fp8.block, skipped)
    return None if job.dtype is not None else "keep"


def _commit(job: _Job, plan: FilePlan, quantization: dict[str, Any] | None | Literal["keep"]) -> WriteResult:
    try:
        copy_files(
            job.extras, job.dir, job.names, job.tag, None if job.dtype is None else dtype_name(job.dtype), quantization
        )
        temps = [job.temp(f) for f in range(len(plan.files))]
        files, index = commit(job.dir, job.names, temps, plan.weight_map(), plan.total_bytes, job.old, job.tag)
    except BaseException:
        remove_uncommitted(job.dir, job.names)
        raise
    return WriteResult(files, index, sum(len(f) for f in plan.files), plan.total_bytes)


def progress_bar(enabled: bool, rank: int, desc: str) -> Any:
    """A tqdm bar in bytes on rank 0 for a writer (None when disabled, on other ranks, or without tqdm).

    Example:
        >>> progress_bar(False, 0, "save_hf") is None
        True
    """
    if not enabled or rank != 0:
        return None
    try:
        from tqdm import tqdm  # optional: the "cli" extra
    except ImportError:
        log.warning("progress=True needs tqdm (pip install tqdm); writing without a progress bar")
        return None
    return tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc=desc, file=sys.stderr)


class _Packing(NamedTuple):
    """What the files' plan depends on besides the targets (part of the plan cache's key)."""

    limit: int
    cast: torch.dtype | None
    fp8: Fp8Quantize | None
    world: int


class Files:
    """The destination "safetensors files" of :func:`save_hf` (a :class:`~shardsync.pipeline.Sink`).

    The plan gives every file one writer and makes it the consumer of the file's targets
    (:func:`~shardsync.io.file_plan.file_owners`); each rank writes its files as they complete, and
    rank 0 commits once every rank has written.

    Example:
        >>> import tempfile
        >>> from shardsync.pipeline import Call, run
        >>> from shardsync.options import Options
        >>> with tempfile.TemporaryDirectory() as d:
        ...     files = Files(_check(d, "5GB", None, None, None, False), rank=0, world=1)
        ...     run(Call({"w": torch.ones(2)}, None, files, Options()), files).num_tensors
        1
    """

    phase = phases.STREAM
    spreads = True

    def __init__(
        self, job: _Job, *, rank: int, world: int, progress: bool = False, memory_budget: int | None = None
    ) -> None:
        self.job, self.rank = job, rank
        self.settings: Hashable = _Packing(job.limit, job.dtype, job.fp8, world)
        self.part = _PartWriter(job, rank, progress_bar(progress, rank, "save_hf"), memory_budget)

    def adapt(self, source: Source) -> Source:
        if self.job.dtype is None:
            return source
        # a dtype asks for values: block-FP8 weights are dequantised
        return dequantized(source, unscaled="cast" if self.job.cast_unscaled_fp8 else "error")

    def entries(self) -> Sequence[LayoutEntry]:
        return ()

    @staticmethod
    def plan(
        mapping: Mapping | None,
        layout: GlobalLayout,
        dest: GlobalLayout,
        options: PlanOptions,
        topology: Topology | None,
        settings: Hashable,
        block: Block,
    ) -> Planned:
        """Resolve, pack into files, and plan each target to its file's writer."""
        assert isinstance(settings, _Packing)
        limit, cast, fp8, world = settings
        targets = sorted(resolve_checked(mapping, layout, block), key=lambda t: t.name)
        owners = file_owners(targets, limit, cast, fp8, world)
        plan = build_plan(targets, layout, replace(options, destinations=owners), topology)
        return Planned(plan, plan.fingerprint())

    def into(self, planned: Planned) -> None:
        return None

    def start(self, prepared: Prepared) -> None:
        self.part.start(prepared.plan)

    def take(self, name: str, tensor: torch.Tensor) -> None:
        try:
            self.part.take(name, tensor)
        except Exception as exc:  # reported in the next phase; this rank keeps serving the stream
            self.part.error = self.part.error or exc

    def finish(self, prepared: Prepared, stats: Stats) -> WriteResult:
        group = prepared.call.group
        try:
            try:
                self.part.finish()
            except Exception as exc:
                self.part.error = self.part.error or exc
            agree(phases.SAVE_HF_WRITE, lambda: _raise(self.part.error), group)
        except BaseException:
            self.abort()
            raise
        self._close_bar()
        plan = self.part.plan
        assert plan is not None and self.part.targets is not None
        quantization = _quantization(self.job, self.part.targets)
        result = agree(
            phases.SAVE_HF_COMMIT, lambda: _commit(self.job, plan, quantization) if self.rank == 0 else None, group
        ).all[0]
        assert result is not None  # rank 0's result, sent to every rank
        return result

    def abort(self) -> None:
        self.part.writer.abort()
        self._close_bar()

    def _close_bar(self) -> None:
        if self.part.bar is not None:
            self.part.bar.close()
            self.part.bar = None


def save_hf(
    source: SourceLike,
    path: str | os.PathLike | None = None,
    mapping: MappingLike | None = None,
    *,
    group: Any = None,
    max_file_size: int | str | None = None,
    dtype: torch.dtype | str | None = None,
    extra_files: Iterable[str | os.PathLike] | None = None,
    config_from: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: bool = False,
    memory_budget: int | str | None = None,
    quantize: Literal["fp8"] | None = None,
    quantize_block: tuple[int, int] = DEFAULT_BLOCK,
    quantize_patterns: Iterable[str] | None = None,
    cast_unscaled_fp8: bool = False,
    out_dir: str | os.PathLike | None = None,
    max_shard_size: int | str | None = None,
) -> WriteResult:
    """Write ``source``, mapped, as a HuggingFace safetensors checkpoint; call on every rank.

    Every rank writes the files whose tensors it receives, in parallel; rank 0 writes the index last,
    after every rank has written its files. The files and index do not depend on the number of ranks.
    A failure on any rank raises on every rank and leaves the directory as it was.

    Args:
        source: this rank's state dict, module, Source or checkpoint path (as for
            :func:`shardsync.full_params`).
        path: the checkpoint directory (created if missing; on a file system every rank shares).
        mapping: None (every source is a target) or a mapping program.
        group: process group; None: the default group when torch.distributed is up, else one process.
        max_file_size: most bytes per file, as HuggingFace reads its ``max_shard_size`` (``"5GB"``,
            the default; ``"500MB"``, an int); a larger tensor gets a file of its own.
        dtype: cast floating targets to this dtype (``torch.bfloat16``, ``"bf16"``); block-FP8 weights
            of the source are dequantised first, and their scales are not written (docs/fp8.md).
        extra_files: paths copied into ``path`` as they are (``config.json``, tokenizer files).
        config_from: a model directory whose ``config.json``, ``generation_config.json`` and tokenizer
            files are copied, so that ``from_pretrained(path)`` works as it is. Without it (and
            without a ``config.json`` among ``extra_files``) a warning says that it will not.
        overwrite: replace a checkpoint already in ``path`` (other files there are never touched).
        progress: a progress bar (bytes, rate, ETA) on rank 0; needs tqdm.
        memory_budget: most bytes the streamer holds at once on any rank (int or ``"2GB"``); the
            writer thread then holds at most as many bytes not yet on disk (256 MiB without one).
        quantize: ``"fp8"``: write the selected targets as block FP8, codes (``float8_e4m3fn``) and
            ``<name>_scale_inv`` (fp32, ``amax / 448`` per block), and give ``config.json`` the matching
            ``quantization_config``.
        quantize_block: rows x columns of a block.
        quantize_patterns: regular expressions of the targets to quantise; None: the Linear weights.
        cast_unscaled_fp8: with ``dtype``, cast FP8 tensors that have no scales as if their codes were
            values (otherwise an error naming them).
        out_dir, max_shard_size: deprecated names of ``path`` and ``max_file_size`` (they warn).

    Returns:
        the committed files and totals (the same on every rank).

    Raises:
        FormatError: ``path`` holds a checkpoint (and not ``overwrite``), bad sizes or extra files.
        PlanError: a non-floating ``dtype``, bad ``quantize`` options (raised by the call).
        LayoutError: with ``dtype``, FP8 tensors without scales, or scales that do not fit their weight.
        DistributedError: a rank failed (raised on every rank, naming it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_hf({"w": torch.ones(2, 3)}, d, dtype="bf16").files[0].name
        'model.safetensors'
    """
    path, max_file_size = _renamed(path, out_dir, max_file_size, max_shard_size)
    rank, world = group_rank(group), group_size(group)
    try:
        opts = Options.of(group, strategy="p2p", copy=False, memory_budget=memory_budget)
        patterns = None if quantize_patterns is None else tuple(quantize_patterns)
        fp8 = Fp8Quantize.of(quantize, quantize_block, patterns)
    except ShardsyncError as exc:
        abandon(phases.SAVE_HF_CHECK, group, exc)
        raise
    job = agree(
        phases.SAVE_HF_CHECK,
        lambda: _check(path, max_file_size, dtype, extra_files, config_from, overwrite, fp8, cast_unscaled_fp8),
        group,
        unanimous=True,
    ).all[0]
    files = Files(job, rank=rank, world=world, progress=progress, memory_budget=opts.plan.memory_budget)
    result = run(Call(source, mapping, files, opts, group), files)
    if rank == 0 and not any(f.name == "config.json" for f in job.extras):
        log.warning(
            "save_hf: %s has no config.json, so from_pretrained will not load it; pass "
            "config_from=<the model's directory> (command line: --config-from DIR)",
            job.dir,
        )
    return result


def _renamed(path: Any, out_dir: Any, size: Any, max_shard_size: Any) -> tuple[Any, Any]:
    """``path`` and ``max_file_size``, taking the deprecated ``out_dir=`` and ``max_shard_size=``."""
    path = _alias(path, out_dir, "path", "out_dir", "or the directory as the second argument")
    if path is None:
        raise PlanError("save_hf: pass the checkpoint directory, save_hf(source, path)")
    size = _alias(size, max_shard_size, "max_file_size", "max_shard_size", "the same sizes")
    return path, "5GB" if size is None else size


def _alias(value: Any, old: Any, name: str, old_name: str, note: str) -> Any:
    """``value``, or ``old`` given under its deprecated name (a DeprecationWarning); not both."""
    if old is None:
        return value
    warnings.warn(f"save_hf({old_name}=...) is deprecated; pass {name}=... ({note})", DeprecationWarning, stacklevel=4)
    if value is not None:
        raise PlanError(f"save_hf: pass {name}= only ({old_name}= is its deprecated name)")
    return old


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
