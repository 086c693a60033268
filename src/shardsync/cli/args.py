"""The argument parser of the ``shardsync`` command (flags, help, and one-line usage errors)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

__all__ = ["parser", "commands"]

_CHECKPOINT = (
    "a checkpoint: a .safetensors file, a safetensors directory or *.safetensors.index.json, or a torch DCP directory"
)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line: ``shardsync <cmd>: <problem> (see ... --help)``."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _path(text: str) -> Path:
    """A path argument; an empty one (an unset ``$OUT``) would mean the working directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names the working directory; give the path")
    return Path(text)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars, warnings or summary")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error, and debug logs")


def _mapping(p: argparse.ArgumentParser, target: str = "the source") -> None:
    p.add_argument(
        "-m",
        "--mapping",
        metavar="FILE",
        help=f"how {target}'s tensors become the output's: a mapping file (.txt, .json, .yaml) "
        "or statements ('a^T -> b'); default: same names",
    )
    p.add_argument(
        "--reverse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a mapping written for the other direction backwards",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="a parameter of the mapping (repeatable), e.g. --set num_heads=32",
    )
    p.add_argument(
        "--strict", action="store_true", help="sources that no statement consumes are an error (default: a warning)"
    )


def _convert(p: argparse.ArgumentParser, with_to: bool) -> None:
    p.add_argument("source", type=_path, metavar="SRC", help=_CHECKPOINT)
    p.add_argument("out", type=_path, metavar="DST", help="output directory")
    _mapping(p)
    if with_to:
        p.add_argument(
            "--to",
            choices=("hf", "dcp"),
            default="hf",
            help="hf: HuggingFace safetensors (default); dcp: torch Distributed Checkpoint",
        )
    p.add_argument(
        "--dtype", help="cast floating tensors, e.g. bf16, fp16, fp32 (block-FP8 weights are dequantised first)"
    )
    p.add_argument(
        "--quantize",
        choices=("fp8",),
        help="write the Linear weights as block FP8 with *_scale_inv scales (docs/fp8.md)",
    )
    p.add_argument(
        "--quantize-block", metavar="ROWS,COLS", default="128,128", help="block of --quantize (default 128,128)"
    )
    p.add_argument(
        "--cast-unscaled-fp8",
        action="store_true",
        help="with --dtype, cast FP8 tensors that have no scales as if their codes were values",
    )
    p.add_argument("--max-shard-size", metavar="SIZE", help="most bytes per file (hf; default 5GB)")
    p.add_argument(
        "--memory-budget", metavar="SIZE", help="most bytes held while reading and building tensors, e.g. 2GB"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="N local workers (torch's launcher, gloo), each reading and writing its part",
    )
    p.add_argument(
        "--config-from",
        type=_path,
        metavar="DIR",
        help="copy config.json and tokenizer files from DIR (hf; default: SRC's own, when "
        "converting without a mapping)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    p.add_argument(
        "--prefix",
        default="",
        metavar="PREFIX",
        help="read only SRC's keys that start with PREFIX, named without it (--prefix model. for "
        "a DCP app state {'model': ..., 'optim': ...})",
    )
    p.add_argument(
        "--keys",
        action="append",
        default=[],
        metavar="GLOB",
        help="read only SRC's keys that match GLOB (repeatable: any of them; matched on the "
        "key as stored, prefix included), e.g. --keys 'model.layers.*'",
    )


def parser(version: str) -> argparse.ArgumentParser:
    """The ``shardsync`` parser: one sub-command per verb.

    Example:
        >>> parser("0").parse_args(["inspect", "ckpt", "--json"]).json
        True
    """
    p = _Parser(
        prog="shardsync",
        description="Convert, inspect, plan, compare and explain checkpoints (safetensors, torch DCP).",
    )
    p.add_argument("--version", action="version", version=f"shardsync {version}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("convert", help="any checkpoint to HF safetensors or torch DCP")
    _convert(s, with_to=True)
    s = sub.add_parser("export", help="convert --to hf (HF safetensors)")
    _convert(s, with_to=False)
    s = sub.add_parser("inspect", help="what a checkpoint holds: tensors, shapes, dtypes, shards, bytes")
    s.add_argument("path", type=_path, metavar="PATH", help=_CHECKPOINT)
    s.add_argument("--json", action="store_true", help="JSON instead of a table")
    s = sub.add_parser("plan", help="dry run of convert: pieces, bytes per worker, collectives, memory")
    s.add_argument("source", type=_path, metavar="SRC", help=_CHECKPOINT)
    _mapping(s)
    s.add_argument("--nproc", type=int, default=1, metavar="N", help="plan for N workers (none started)")
    s.add_argument("--memory-budget", metavar="SIZE", help="plan to hold at most SIZE, e.g. 2GB")
    s.add_argument("--json", action="store_true", help="JSON instead of tables")
    s = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (exit 1 if they differ)")
    s.add_argument("a", type=_path, metavar="A", help=_CHECKPOINT + " (the mapping applies to it)")
    s.add_argument("b", type=_path, metavar="B", help=_CHECKPOINT)
    _mapping(s, "A")
    s.add_argument(
        "--atol", type=float, default=0.0, help="largest absolute difference that counts as equal (default 0: exact)"
    )
    s.add_argument(
        "--ignore-dtype",
        action="store_true",
        help="compare values only, not dtypes (to check a conversion with --dtype)",
    )
    s.add_argument("--memory-budget", metavar="SIZE", help="most bytes held while reading A")
    s.add_argument("--json", action="store_true", help="JSON instead of text")
    s = sub.add_parser("verify", help="compare two checkpoints of any layouts by digest (exit 1 if they differ)")
    s.add_argument("a", type=Path, metavar="A", help=_CHECKPOINT + " (the mapping applies to it)")
    s.add_argument("b", type=Path, metavar="B", help=_CHECKPOINT)
    _mapping(s, "A")
    s.add_argument("--json", action="store_true", help="JSON instead of text")
    s = sub.add_parser("explain", help="how each target of a mapping is built (reads headers only)")
    s.add_argument("source", type=_path, metavar="SRC", help=_CHECKPOINT + ", or a layout .json")
    _mapping(s)
    for name in sub.choices:
        _common(sub.choices[name])
    return p


def commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each command of ``p`` (made by :func:`parser`), by name."""
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)
