"""``shardsync verify``: compare two checkpoints of any layouts and formats by digest, ``A`` through a
mapping.

Each side is hashed where its bytes lie, box by box, into one digest per tensor that does not depend
on how the tensor is cut into files or shards (docs/digests.md); nothing is gathered. Per tensor:
equal, different (values, shape or dtype), or missing on one side. Exit status 0: equal; 1: a
difference or a missing tensor. Unlike ``diff`` it says *whether* tensors are equal bit for bit, not by
how much they differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..digests import VerifyReport, verify
from .table import Comparison, folded_list

__all__ = ["VerifyConfig", "run_verify", "document", "text"]


@dataclass(frozen=True)
class VerifyConfig(Comparison):
    """``shardsync verify``: the two checkpoints and the mapping applied to ``a`` (no options of its own)."""


def document(report: VerifyReport, cfg: VerifyConfig) -> dict[str, Any]:
    """The JSON document ``verify --json`` prints: ``ok``, and per tensor its status and digests."""
    return {**cfg.header(), **json.loads(report.to_json())}


def text(report: VerifyReport) -> str:
    """The lines ``verify`` prints: what differs or is missing, then a summary line."""
    lines = []
    for what, names in (("different", report.different), ("only in A", report.only_a), ("only in B", report.only_b)):
        if names:
            lines.append(f"{what} ({len(names)}): {folded_list(names)}")
    if report.ok:
        lines.append(f"equal: {len(report.equal)} tensors, every digest matches")
    else:
        lines.append(
            f"differ: {len(report.different)} different, {len(report.equal)} equal, "
            f"{len(report.only_a)} only in A, {len(report.only_b)} only in B"
        )
    return "\n".join(lines)


def run_verify(cfg: VerifyConfig) -> tuple[str, int]:
    """What ``shardsync verify`` prints, and its exit status (0 equal, 1 a difference).

    Raises:
        FormatError: either path is not a checkpoint; MappingError: the mapping does not fit ``a``.
    """
    source_a, source_b, mapping, _ = cfg.open()
    report = verify(source_a, source_b, mapping)
    return cfg.output(lambda: document(report, cfg), lambda: text(report)), 0 if report.ok else 1
