"""``shardsync inspect``: what a checkpoint holds, from its headers or metadata alone.

Format, files, and every tensor's shape, dtype, bytes and shards (the boxes it is stored in, and the
files holding them), as a table with numbered names folded (``layers.{0..31}.mlp.w``) or as JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..layout.dtypes import itemsize
from ..sources import DcpSource, SafetensorsSource, Source, open_source
from .table import Row, fold, json_text, render
from .units import human_bytes

__all__ = ["InspectConfig", "describe_checkpoint", "run_inspect"]


@dataclass(frozen=True)
class InspectConfig:
    """``shardsync inspect``: the checkpoint, and JSON instead of a table."""

    path: Path
    as_json: bool = False


def _shards(source: Source, root: Path) -> dict[str, list[dict[str, Any]]]:
    """Each tensor's stored boxes with the file holding each (its path under ``root``: an index may
    name files in subdirectories)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if isinstance(source, SafetensorsSource):
        for key, info in source.tensors.items():
            out[key] = [
                {
                    "offsets": [0] * len(info.shape),
                    "sizes": list(info.shape),
                    "file": info.file.relative_to(root).as_posix(),
                }
            ]
        return out
    assert isinstance(source, DcpSource)  # open_source makes one of the two from a path
    for e in source.entries():
        out.setdefault(e.key, []).append(
            {"offsets": list(e.box.offsets), "sizes": list(e.box.sizes), "file": source.chunk_file(e.key, e.box)}
        )
    return out


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """The JSON document ``inspect --json`` prints.

    Raises:
        FormatError: ``path`` is not a checkpoint.

    Example:
        >>> import tempfile, torch; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.zeros(2, 3)}, f"{d}/model.safetensors")
        ...     doc = describe_checkpoint(Path(d))
        >>> doc["format"], doc["total_bytes"], doc["tensors"]["w"]["shards"]
        ('safetensors', 24, [{'offsets': [0, 0], 'sizes': [2, 3], 'file': 'model.safetensors'}])
    """
    source = open_source(path)
    root = path if path.is_dir() else path.parent
    shards = _shards(source, root)
    layout = {e.key: e for e in source.entries()}
    names = sorted({s["file"] for boxes in shards.values() for s in boxes if s["file"] is not None})
    tensors = {
        key: {
            "shape": list(layout[key].shape),
            "dtype": layout[key].dtype,
            "bytes": math.prod(layout[key].shape) * itemsize(layout[key].dtype),
            "shards": boxes,
        }
        for key, boxes in sorted(shards.items())
    }
    return {
        "path": str(path),
        "format": "dcp" if isinstance(source, DcpSource) else "safetensors",
        "files": [{"name": n, "bytes": (root / n).stat().st_size} for n in names],
        "num_tensors": len(tensors),
        "total_bytes": sum(t["bytes"] for t in tensors.values()),
        "tensors": tensors,
    }


def _files_cell(files: frozenset[Any]) -> str:
    return next(iter(files)) if len(files) == 1 else f"{len(files)} files"


def table(doc: dict[str, Any]) -> str:
    """The folded table ``inspect`` prints for a :func:`describe_checkpoint` document."""
    rows = [
        Row(
            (key,),
            (tuple(t["shape"]), t["dtype"], len(t["shards"])),
            1,
            t["bytes"],
            (frozenset(s["file"] for s in t["shards"]),),
        )
        for key, t in doc["tensors"].items()
    ]
    body = [
        (
            names[0],
            str(row.count),
            str(list(row.same[0])),
            str(row.same[1]),
            str(row.same[2]),
            _files_cell(row.sets[0]),
            human_bytes(row.nbytes),
        )
        for names, row in fold(rows)
    ]
    nfiles = len(doc["files"])
    head = (
        f"{doc['path']}: {'torch DCP' if doc['format'] == 'dcp' else 'safetensors'} checkpoint, "
        f"{doc['num_tensors']} tensors, {human_bytes(doc['total_bytes'])} in {nfiles} file"
        f"{'s' if nfiles != 1 else ''}"
    )
    cols = ("tensor", "n", "shape", "dtype", "shards", "files", "bytes")
    return head + "\n" + render(cols, body, right=(1, 4, 6))


def run_inspect(cfg: InspectConfig) -> str:
    """What ``shardsync inspect`` prints."""
    doc = describe_checkpoint(cfg.path)
    return json_text(doc) if cfg.as_json else table(doc)
