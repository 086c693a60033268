"""``save_dcp``: write mapped targets as a torch DCP checkpoint, every rank writing its share.

The sibling of :func:`~shardsync.save_hf` for torch's format (what ``shardsync convert --to dcp``
runs). The protocol, on every rank of the group: check the options and the directory (``agree``) ->
the orchestrator (:mod:`shardsync.pipeline`) into :class:`DcpFiles`: every rank is the consumer of a
contiguous part of the targets (split by bytes) and keeps them (cast or quantised as asked) until
the stream ends -> :func:`shardsync.io.dcp_writer.save` writes every rank's part through torch's DCP
writer and commits ``.metadata`` last (crash-safe, as :func:`shardsync.save` is).

Memory: each rank holds its part of the targets until DCP has written them (about the total divided
by the number of ranks), plus what the streamer holds (at most ``memory_budget``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from .. import phases
from ..dist import abandon, agree, group_rank, group_size
from ..errors import ShardsyncError
from ..exec import Stats
from ..layout.dtypes import itemsize
from ..layout.meta import LayoutEntry
from ..mapping import MappingLike
from ..options import Options
from ..pipeline import Call, Prepared, run
from ..quant.fp8 import DEFAULT_BLOCK, Fp8Quantize, written
from ..sources import Source, SourceLike
from ..sources.fp8 import dequantized
from ..stream import ToConsumers
from .commit import check_dcp_directory, output_dir
from .file_plan import output_cast, output_dtype
from .save_hf import progress_bar

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["save_dcp", "DcpFiles"]


def _check(path: str | os.PathLike, overwrite: bool, dtype: Any) -> tuple[Path, torch.dtype | None]:
    where = output_dir(path, "path")
    check_dcp_directory(where, overwrite)
    return where, output_cast(dtype)


class DcpFiles(ToConsumers):
    """The destination "a torch DCP checkpoint" of :func:`save_dcp` (a :class:`~shardsync.pipeline.Sink`):
    whole targets to their consumers, kept until DCP writes every rank's part.

    Example:
        >>> import tempfile
        >>> from shardsync.pipeline import Call, run
        >>> with tempfile.TemporaryDirectory() as d:
        ...     sink = DcpFiles(Path(d), rank=0)
        ...     md = run(Call({"w": torch.ones(2)}, None, sink, Options()), sink)
        ...     sorted(md.state_dict_metadata)
        ['w']
    """

    settings: Hashable = "dcp files"

    def __init__(
        self,
        path: Path,
        *,
        rank: int,
        dtype: torch.dtype | None = None,
        fp8: Fp8Quantize | None = None,
        overwrite: bool = False,
        progress: bool = False,
        cast_unscaled_fp8: bool = False,
    ) -> None:
        self.path, self.rank, self.dtype, self.fp8, self.overwrite = path, rank, dtype, fp8, overwrite
        self.cast_unscaled_fp8 = cast_unscaled_fp8
        self.state: dict[str, torch.Tensor] = {}
        self.error: Exception | None = None  # the first target this rank failed to take
        self.bar = progress_bar(progress, rank, "save_dcp")

    def adapt(self, source: Source) -> Source:
        if self.dtype is None:
            return source
        # a dtype asks for values: block-FP8 weights are dequantised
        return dequantized(source, unscaled="cast" if self.cast_unscaled_fp8 else "error")

    def entries(self) -> Sequence[LayoutEntry]:
        return ()

    def start(self, prepared: Prepared) -> None:
        if self.bar is not None:
            mine = [t for t in prepared.plan.targets if self.rank in t.consumers]
            self.bar.total = sum(math.prod(t.shape) * itemsize(output_dtype(t.dtype, self.dtype)) for t in mine)

    def take(self, name: str, tensor: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            pieces = written(name, tensor, self.fp8, self.dtype)
        except Exception as exc:  # reported in the next agreed phase: this rank keeps serving the stream
            self.error = exc
            return
        self.state.update(pieces)
        if self.bar is not None:
            self.bar.update(sum(t.numel() * t.element_size() for _, t in pieces))

    def finish(self, prepared: Prepared, stats: Stats) -> Metadata:
        self._close_bar()  # the stream is done
        agree(phases.SAVE_DCP_TAKE, lambda: _raise(self.error), prepared.call.group)  # on every rank
        from .dcp_writer import save  # local: torch.distributed.checkpoint is slow to import

        return save(self.state, self.path, group=prepared.call.group, overwrite=self.overwrite)

    def abort(self) -> None:
        self.state.clear()
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def save_dcp(
    source: SourceLike,
    path: str | os.PathLike,
    mapping: MappingLike | None = None,
    *,
    group: Any = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    memory_budget: int | str | None = None,
    quantize: Literal["fp8"] | None = None,
    quantize_block: tuple[int, int] = DEFAULT_BLOCK,
    quantize_patterns: Iterable[str] | None = None,
    cast_unscaled_fp8: bool = False,
) -> Metadata:
    """Write ``source``, mapped, as a torch DCP checkpoint; call on every rank.

    The arguments are :func:`~shardsync.save_hf`'s, less those of safetensors files (``max_file_size``,
    ``config_from``, ``extra_files``): DCP writes one data file per rank. ``torch.distributed.checkpoint.load``
    reads the result into any sharding, and :mod:`shardsync` sources read it back.

    Args:
        source: this rank's state dict, module, Source or checkpoint path (as for
            :func:`~shardsync.full_params`).
        path: the checkpoint directory (created if missing; on a file system every rank shares).
        mapping: None (every source is a target) or a mapping program.
        group: process group; None: the default group when torch.distributed is up, else one process.
        dtype: cast floating targets to this dtype; block-FP8 weights are dequantised first.
        overwrite: replace a DCP checkpoint already in ``path`` (other files are never touched).
        progress: a progress bar (bytes) on rank 0; needs tqdm.
        memory_budget: most bytes the streamer holds at once on any rank (the targets each rank keeps
            until DCP writes them come on top: about the total divided by the number of ranks).
        quantize, quantize_block, quantize_patterns, cast_unscaled_fp8: as for :func:`~shardsync.save_hf`.

    Returns:
        DCP's metadata of the checkpoint (the same on every rank).

    Raises:
        FormatError: ``path`` holds a DCP checkpoint (and not ``overwrite``), or is a file.
        PlanError: a non-floating ``dtype``, bad ``quantize`` options or sizes.
        MappingError, LayoutError: the mapping or the source is wrong (on every rank).
        DistributedError: a rank failed (raised on every rank, naming it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     md = save_dcp({"w": torch.arange(6.).reshape(2, 3)}, d, "w^T -> w_t", dtype="bf16")
        ...     md.state_dict_metadata["w_t"].size, md.state_dict_metadata["w_t"].properties.dtype
        (torch.Size([3, 2]), torch.bfloat16)
    """
    world = group_size(group)
    try:
        opts = Options.of(
            group,
            copy=False,
            split_by="bytes",
            memory_budget=memory_budget,
            consumers=tuple(range(world)) if world > 1 else None,
        )
        fp8 = Fp8Quantize.of(quantize, quantize_block, None if quantize_patterns is None else tuple(quantize_patterns))
    except ShardsyncError as exc:
        abandon(phases.SAVE_DCP_CHECK, group, exc)
        raise
    where, cast = agree(phases.SAVE_DCP_CHECK, lambda: _check(path, overwrite, dtype), group, unanimous=True).all[0]
    sink = DcpFiles(
        where,
        rank=group_rank(group),
        dtype=cast,
        fp8=fp8,
        overwrite=overwrite,
        progress=progress,
        cast_unscaled_fp8=cast_unscaled_fp8,
    )
    return run(Call(source, mapping, sink, opts, group), sink)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error
