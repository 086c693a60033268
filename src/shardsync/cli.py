"""Command line: ``shardsync explain`` and ``shardsync export`` (thin: arguments -> config -> API).

Examples::

    shardsync explain ckpt/ --mapping megatron_llama_to_hf.txt
    shardsync export ckpt/ hf_out/ --mapping megatron_llama_to_hf.txt --max-shard-size 5GB
    shardsync export dcp_step_1000/ hf_out/ --memory-budget 2GiB

A checkpoint is a safetensors file or directory, or a torch DCP directory (format detected).
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

from .errors import FormatError, ShardsyncError
from .io import parse_size, save_safetensors
from .layout.meta import GlobalLayout
from .mapping import Mapping
from .mapping.explain import explain
from .sources import open_source
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
    """``shardsync export``: map a checkpoint (safetensors or DCP) and write it as HF safetensors,
    holding at most ``memory_budget`` bytes of tensors being built at once (None: no limit)."""

    source: Path
    out: Path
    mapping: str | None = None
    reverse: bool | None = None
    max_shard_size: str = "5GB"
    overwrite: bool = False
    progress: bool = True
    memory_budget: int | None = None


def _layout(source: Path) -> GlobalLayout:
    if source.suffix == ".json" and not source.name.endswith(".index.json"):
        try:
            return GlobalLayout.from_json(source.read_text())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{source} is not a layout JSON (as GlobalLayout.to_json writes) nor a "
                              f"checkpoint: {type(exc).__name__}: {exc}") from exc
    return GlobalLayout.merge([open_source(source).entries()])


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
    mapping = Mapping.parse(cfg.mapping or [], reverse=cfg.reverse)
    stream = full_params(cfg.source, mapping, copy=False, memory_budget=cfg.memory_budget)
    result = save_safetensors(_progress(stream, cfg.progress), cfg.out,
                              max_shard_bytes=cfg.max_shard_size, overwrite=cfg.overwrite)
    return {"tensors": result.num_tensors, "bytes": result.total_bytes, "files": len(result.files),
            "seconds": time.perf_counter() - start}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardsync", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("explain", "show how every target is built (reads headers only)"),
                           ("export", "map a checkpoint into HF safetensors")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("source", type=Path, help="a .safetensors file, a safetensors checkpoint "
                       "directory, an index.json, a torch DCP directory"
                       + (", or a layout .json" if name == "explain" else ""))
        if name == "export":
            s.add_argument("out", type=Path, help="output directory")
            s.add_argument("--max-shard-size", default="5GB", help="shard size limit (default 5GB)")
            s.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
            s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
            s.add_argument("--memory-budget", type=parse_size, default=None,
                           help="most bytes of tensors held while building them, e.g. 2GiB")
        s.add_argument("-m", "--mapping", help="mapping file (.txt/.json/.yaml); default: identity")
        s.add_argument("--reverse", action="store_true", default=None,
                       help="run a load-direction mapping backwards")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardsync`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "explain":
            print(run_explain(ExplainConfig(args.source, args.mapping, args.reverse)))
        else:
            summary = run_export(ExportConfig(args.source, args.out, args.mapping, args.reverse,
                                              args.max_shard_size, args.overwrite, not args.quiet,
                                              args.memory_budget))
            gb = summary["bytes"] / 1e9
            print(f"wrote {summary['tensors']} tensors, {gb:.3f} GB in {summary['files']} file(s) to "
                  f"{args.out} in {summary['seconds']:.2f} s ({gb / max(summary['seconds'], 1e-9):.2f} GB/s)")
    except (ShardsyncError, FileNotFoundError) as exc:
        print(f"shardsync {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0
