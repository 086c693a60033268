"""Command line: ``shardsync explain`` and ``shardsync export`` (thin: arguments -> config -> API).

Examples::

    shardsync explain ckpt/ --mapping megatron_llama_to_hf.txt
    shardsync export ckpt/ hf_out/ --mapping megatron_llama_to_hf.txt --max-shard-size 5GB
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ShardsyncError
from .exec.memory import tune_allocator
from .io import read_layout, read_tensors, save_safetensors
from .layout.meta import GlobalLayout
from .mapping import Mapping
from .mapping.explain import explain
from .stream import ParamStream, full_params

__all__ = ["ExplainConfig", "ExportConfig", "main", "run_explain", "run_export"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExplainConfig:
    """``shardsync explain``: how each target of a mapping is built from a checkpoint's layout."""

    source: Path
    mapping: str | None = None
    reverse: bool | None = None


@dataclass(frozen=True)
class ExportConfig:
    """``shardsync export``: map a safetensors checkpoint and write it as HF safetensors."""

    source: Path
    out: Path
    mapping: str | None = None
    reverse: bool | None = None
    max_shard_size: str = "5GB"
    overwrite: bool = False
    progress: bool = True


def _layout(source: Path) -> GlobalLayout:
    if source.suffix == ".json" and not source.name.endswith(".index.json"):
        return GlobalLayout.from_json(source.read_text())
    return read_layout(source)


def run_explain(cfg: ExplainConfig) -> str:
    """The text ``shardsync explain`` prints."""
    return explain(_layout(cfg.source), cfg.mapping, reverse=cfg.reverse)


def _progress(stream: ParamStream, enabled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from tqdm import tqdm  # optional (the "cli" extra)
    except ImportError:
        enabled = False
    if not enabled:
        yield from stream
        return
    with tqdm(unit="tensor", file=sys.stderr) as bar:
        for name, tensor in stream:
            if bar.total is None and stream.plan is not None:  # known once planning is done
                bar.total = len(stream.plan.order)
            bar.set_postfix_str(name[-40:], refresh=False)
            yield name, tensor
            bar.update(1)


def run_export(cfg: ExportConfig) -> dict[str, float]:
    """Read, map and write; returns a summary (tensors, bytes, files, seconds)."""
    start = time.perf_counter()
    state = read_tensors(cfg.source)
    mapping = Mapping.parse(cfg.mapping or [], reverse=cfg.reverse)
    stream = full_params(state, mapping, copy=False)
    result = save_safetensors(_progress(stream, cfg.progress), cfg.out,
                              max_shard_bytes=cfg.max_shard_size, overwrite=cfg.overwrite)
    return {"tensors": result.num_tensors, "bytes": result.total_bytes, "files": len(result.files),
            "seconds": time.perf_counter() - start}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardsync", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("explain", "show how every target is built (reads headers only)"),
                           ("export", "map a safetensors checkpoint into HF safetensors")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("source", type=Path, help="a .safetensors file, a checkpoint directory, an "
                       "index.json" + (", or a layout .json" if name == "explain" else ""))
        if name == "export":
            s.add_argument("out", type=Path, help="output directory")
            s.add_argument("--max-shard-size", default="5GB", help="shard size limit (default 5GB)")
            s.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
            s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        s.add_argument("-m", "--mapping", help="mapping file (.txt/.json/.yaml); default: identity")
        s.add_argument("--reverse", action="store_true", default=None,
                       help="run a load-direction mapping backwards")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardsync`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tune_allocator()  # this process owns its allocator: keep freed memory warm (docs/performance.md)
    try:
        if args.command == "explain":
            print(run_explain(ExplainConfig(args.source, args.mapping, args.reverse)))
        else:
            summary = run_export(ExportConfig(args.source, args.out, args.mapping, args.reverse,
                                              args.max_shard_size, args.overwrite, not args.quiet))
            gb = summary["bytes"] / 1e9
            print(f"wrote {summary['tensors']} tensors, {gb:.3f} GB in {summary['files']} file(s) to "
                  f"{args.out} in {summary['seconds']:.2f} s ({gb / max(summary['seconds'], 1e-9):.2f} GB/s)")
    except (ShardsyncError, FileNotFoundError) as exc:
        print(f"shardsync {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0
