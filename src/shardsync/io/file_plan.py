"""Which targets go in which safetensors file, and which rank writes it (:func:`plan_files`,
:func:`file_owners`).

The packing depends only on the targets (sorted by name) and the size limit, never on the number of
ranks: one writer and eight parallel writers produce the same files. Ownership is planned before
anything moves: :func:`file_owners` gives each file a writer (contiguous runs of files, balanced by
bytes; a target whose codes and scales straddle two files keeps both with one writer) and makes that
writer the consumer of each of the file's targets, so no target ever has to move again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PlanError
from ..layout.box import Box
from ..layout.dtypes import dtype_name, itemsize, to_torch_dtype
from ..mapping.pieces import TargetSpec
from ..planning import TargetPlan, split_ranges
from ..quant.fp8 import Fp8Quantize, scale_key, scale_shape
from .safetensors_writer import starts_new_shard

__all__ = ["FilePlan", "plan_files", "file_owners", "output_cast", "output_dtype", "written_tensors"]


@dataclass(frozen=True, slots=True)
class FilePlan:
    """The files of a checkpoint and their writers; identical on every rank.

    Attributes:
        files: target names per file, in file order.
        writers: the group rank that writes each file.
        total_bytes: bytes of all targets as written (after any cast).

    Example:
        >>> plan = FilePlan((("a", "b"), ("c",)), (0, 1), 24)
        >>> plan.file_of("c"), plan.files_of(1)
        (1, [1])
    """

    files: tuple[tuple[str, ...], ...]
    writers: tuple[int, ...]
    total_bytes: int

    def file_of(self, name: str) -> int:
        """Index of the file holding target ``name``."""
        for i, names in enumerate(self.files):
            if name in names:
                return i
        raise KeyError(name)

    def files_of(self, rank: int) -> list[int]:
        """Indices of the files ``rank`` writes."""
        return [i for i, w in enumerate(self.writers) if w == rank]

    def weight_map(self) -> dict[str, int]:
        """Target name -> file index."""
        return {name: i for i, names in enumerate(self.files) for name in names}


def output_cast(dtype: Any) -> torch.dtype | None:
    """The dtype a writer casts floating targets to (None: each its own), checked.

    Raises:
        PlanError: ``dtype`` is not a floating dtype.

    Example:
        >>> output_cast("bf16"), output_cast(None)
        (torch.bfloat16, None)
    """
    cast = None if dtype is None else to_torch_dtype(dtype)
    if cast is not None and not cast.is_floating_point:
        raise PlanError(f"dtype={dtype!r} is not a floating dtype; give e.g. torch.bfloat16 or 'bf16'")
    return cast


def output_dtype(dtype: str, cast: torch.dtype | None) -> str:
    """The dtype a target is written in: ``cast`` for floating targets, else its own.

    Example:
        >>> output_dtype("float32", torch.bfloat16), output_dtype("int64", torch.bfloat16)
        ('bfloat16', 'int64')
    """
    if cast is not None and to_torch_dtype(dtype).is_floating_point:
        return dtype_name(cast)
    return dtype


def written_tensors(
    targets: Sequence[TargetPlan], cast: torch.dtype | None = None, fp8: Fp8Quantize | None = None
) -> list[TargetPlan]:
    """The tensors written for ``targets``, sorted by name, each in the dtype it is written in: a target
    ``fp8`` selects as its codes and its scales (``<name>_scale_inv``), every other floating one cast.

    Raises:
        PlanError: a scale key is also the name of a target.

    Example:
        >>> t = [TargetPlan("a.weight", (300, 17), "float32", (0,), ())]
        >>> [(w.name, w.shape, w.dtype) for w in written_tensors(t, torch.bfloat16, Fp8Quantize())]
        [('a.weight', (300, 17), 'float8_e4m3fn'), ('a.weight_scale_inv', (3, 1), 'float32')]
    """
    out = []
    for t in targets:
        if fp8 is not None and fp8.selects(t.name, t.shape, t.dtype):
            out += [
                TargetPlan(t.name, t.shape, "float8_e4m3fn", t.consumers, ()),
                TargetPlan(scale_key(t.name), scale_shape(t.shape, fp8.block), "float32", t.consumers, ()),
            ]
        else:
            out.append(TargetPlan(t.name, t.shape, output_dtype(t.dtype, cast), t.consumers, ()))
    names = [t.name for t in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PlanError(
            f"quantize='fp8' would write {twice} twice: targets already named like the scales "
            "of quantised weights; rename them in the mapping, or narrow quantize_patterns"
        )
    return sorted(out, key=lambda t: t.name)


def plan_files(
    targets: Sequence[TargetPlan], limit: int, cast: torch.dtype | None = None, fp8: Fp8Quantize | None = None
) -> FilePlan:
    """Pack ``targets`` (in the plan's order: sorted by name) into files of at most ``limit`` bytes.

    A target larger than the limit gets a file of its own; no targets give one empty file (rank 0).
    Each file is written by the rank that receives its first target (:func:`file_owners` makes that
    the receiver of all of them). What is packed is :func:`written_tensors` (cast by ``cast``,
    quantised by ``fp8``).

    Raises:
        PlanError: a file's targets are received by different ranks (their ownership was not planned).

    Example:
        >>> t = [TargetPlan(n, (4,), "float32", (r,), ()) for n, r in (("a", 0), ("b", 0), ("c", 1))]
        >>> p = plan_files(t, limit=40)
        >>> p.files, p.writers
        ((('a', 'b'), ('c',)), (0, 1))
    """
    files = _pack(written_tensors(targets, cast, fp8), limit)
    if not files:
        return FilePlan(((),), (0,), 0)
    writers = tuple(_receiver(f[0]) for f in files)
    strays = sorted(t.name for f, w in zip(files, writers) for t in f if _receiver(t) != w)
    if strays:
        raise PlanError(
            f"targets {strays} are received by another rank than their file's writer; plan "
            "the targets with file_owners()"
        )
    total = sum(_nbytes(t) for f in files for t in f)
    return FilePlan(tuple(tuple(t.name for t in f) for f in files), writers, total)


def file_owners(
    targets: Sequence[TargetSpec], limit: int, cast: torch.dtype | None, fp8: Fp8Quantize | None, world: int
) -> tuple[tuple[int], ...]:
    """The rank that receives (and writes) each of ``targets`` (sorted by name), for ``world`` writers.

    Files are cut into runs no target straddles, and the runs into ``world`` contiguous parts of
    about equal bytes; each target goes to the writer of its files.

    Example:
        >>> t = [TargetSpec(n, (4,), "float32", ()) for n in "abcd"]
        >>> file_owners(t, limit=32, cast=None, fp8=None, world=2)
        ((0,), (0,), (1,), (1,))
    """
    unowned = [TargetPlan(t.name, t.shape, t.dtype, (), ()) for t in targets]
    files = _pack(written_tensors(unowned, cast, fp8), limit)
    file_of = {w.name: i for i, f in enumerate(files) for w in f}
    spans = [[file_of[w.name] for w in written_tensors([t], cast, fp8)] for t in unowned]
    # a run ends after file i unless some target has written tensors in file i and a later one
    last_of_run = [True] * len(files)
    for span in spans:
        for i in range(min(span), max(span)):
            last_of_run[i] = False
    runs, run_of = [0], []
    for i, f in enumerate(files):
        run_of.append(len(runs) - 1)
        runs[-1] += sum(_nbytes(w) for w in f)
        if last_of_run[i] and i + 1 < len(files):
            runs.append(0)
    writer_of_run = [0] * len(runs)
    for rank, part in enumerate(split_ranges(runs, world, "bytes")):
        for r in part:
            writer_of_run[r] = rank
    return tuple((writer_of_run[run_of[min(span)]],) for span in spans)


def _pack(tensors: Sequence[TargetPlan], limit: int) -> list[list[TargetPlan]]:
    files: list[list[TargetPlan]] = []
    filled = 0
    for t in tensors:
        nbytes = _nbytes(t)
        if not files or starts_new_shard(filled, nbytes, limit):
            files.append([])
            filled = 0
        files[-1].append(t)
        filled += nbytes
    return files


def _nbytes(t: TargetPlan) -> int:
    return Box.full(t.shape).numel * itemsize(t.dtype)


def _receiver(t: TargetPlan) -> int:
    return t.consumers[0] if t.consumers else 0
