"""The ``shardsync`` command: convert, inspect, plan, diff, verify and explain checkpoints.

Examples::

    shardsync inspect ckpt/
    shardsync convert dcp_step_1000/ hf_out/ --mapping megatron_llama_to_hf.txt --dtype bf16 --nproc 4
    shardsync plan dcp_step_1000/ --mapping megatron_llama_to_hf.txt --nproc 4
    shardsync diff dcp_step_1000/ hf_out/ --mapping megatron_llama_to_hf.txt --atol 1e-2
    shardsync verify dcp_step_1000/ hf_out/ --mapping megatron_llama_to_hf.txt

A checkpoint is a safetensors file or directory, or a torch DCP directory (format detected). Each
command parses its flags into a config dataclass and calls the same functions as the API. Exit
status: 0 success; 1 ``diff`` or ``verify`` found differences; 2 a user error (one line on stderr,
``shardsync <cmd>: <what is wrong> (<how to fix>)``); 3 a bug (``--debug`` shows the traceback); 130
interrupted (Ctrl-C, one line).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TextIO

from .. import __version__
from ..exec.memory import tune_allocator
from ..layout.meta import GlobalLayout
from ..mapping.explain import describe_targets
from ..sources import open_source
from ..startup import noting_interrupts
from .args import commands, parser
from .common import MappingFlags, command_logging, dtype_flag, parse_sets, size_flag, source_dir, workers_flag
from .convert import ConvertConfig, run_convert
from .diff import DiffConfig, run_diff
from .inspect import InspectConfig, run_inspect
from .launch import WorkerFailed, launched_world, run_launched
from .messages import BROKEN_PIPE, UsageError, one_line, printable
from .plan import PlanConfig, run_plan
from .verify import VerifyConfig, run_verify

__all__ = ["main", "convert_config", "run_explain"]


def run_explain(cfg: PlanConfig) -> str:
    """The text ``shardsync explain`` prints: every target and its pieces (``cfg.source`` may also be
    a layout JSON, as ``GlobalLayout.to_json`` writes)."""
    if cfg.source.suffix == ".json" and not cfg.source.name.endswith(".index.json"):
        layout = _layout_json(cfg.source)
    else:
        layout = GlobalLayout.merge([open_source(cfg.source).entries()])
    return describe_targets(cfg.flags.resolve(layout, source_dir(cfg.source))[1])


def _layout_json(path: Path) -> GlobalLayout:
    from ..errors import FormatError
    from ..files import read_bounded

    text = read_bounded(path, 1 << 30)  # a FIFO or device is refused, not read without end
    try:
        return GlobalLayout.from_json(text.decode("utf-8"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise FormatError(
            f"{path} is not a layout JSON (as GlobalLayout.to_json writes) nor a checkpoint: "
            f"{type(exc).__name__}: {exc}; pass a checkpoint or a layout JSON"
        ) from exc


def _print(text: str, file: TextIO | None = None) -> None:
    """Print what a command shows; names from a checkpoint may hold terminal escape codes."""
    print(printable(text), file=file or sys.stdout)


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars: on a terminal, unless --quiet."""
    return not args.quiet and sys.stderr.isatty()


def _mapping_flags(args: argparse.Namespace) -> MappingFlags:
    return MappingFlags(args.mapping, args.reverse, tuple(parse_sets(args.set).items()), args.strict)


def convert_config(args: argparse.Namespace, to: Literal["hf", "dcp"] | None = None) -> ConvertConfig:
    """The checked flags of ``convert`` (``export``: ``to="hf"``).

    Raises:
        UsageError: a flag value that is wrong (size, dtype, number of workers).
    """
    nproc = workers_flag(args.nproc)
    return ConvertConfig(
        args.source,
        args.out,
        _mapping_flags(args),
        to=to or args.to,
        dtype=dtype_flag(args.dtype),
        max_shard_size=size_flag(args.max_shard_size, "--max-shard-size"),
        memory_budget=size_flag(args.memory_budget, "--memory-budget"),
        nproc=nproc,
        config_from=args.config_from,
        overwrite=args.overwrite,
        progress=_progress(args),
        prefix=args.prefix,
        keys=tuple(args.keys),
        quantize=args.quantize,
        quantize_block=_block_flag(args.quantize_block),
        cast_unscaled_fp8=args.cast_unscaled_fp8,
    )


def _block_flag(value: str) -> tuple[int, int]:
    """``--quantize-block ROWS,COLS``.

    Raises:
        UsageError: not two positive integers.
    """
    parts = value.replace("x", ",").split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UsageError(f"--quantize-block {value!r} is not a block", "give rows and columns, e.g. 128,128")
    return int(parts[0]), int(parts[1])


def _convert(args: argparse.Namespace, to: Literal["hf", "dcp"] | None = None) -> int:
    cfg = convert_config(args, to)
    if launched_world() > 1:
        if cfg.nproc > 1:
            raise UsageError(
                f"--nproc {cfg.nproc} under torchrun, which already started {launched_world()} workers", "drop --nproc"
            )
        line, status = run_launched(cfg)
        if line and (status or not args.quiet):
            _print(line, sys.stderr if status else sys.stdout)
        return status
    done = run_convert(cfg)
    if not args.quiet:
        _print(done.summary(cfg.out))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    _print(run_inspect(InspectConfig(args.path, args.json)))
    return 0


def _plan_config(args: argparse.Namespace) -> PlanConfig:
    extra = vars(args)  # explain has the source and mapping flags only
    return PlanConfig(
        args.source,
        _mapping_flags(args),
        nproc=extra.get("nproc", 1),
        memory_budget=size_flag(extra.get("memory_budget"), "--memory-budget"),
        as_json=extra.get("json", False),
    )


def _plan(args: argparse.Namespace) -> int:
    _print(run_plan(_plan_config(args)))
    return 0


def _explain(args: argparse.Namespace) -> int:
    _print(run_explain(_plan_config(args)))
    return 0


def _diff(args: argparse.Namespace) -> int:
    atol = args.atol
    if not atol >= 0:
        raise UsageError(f"--atol {atol} is not a tolerance", "give 0 or a positive number")
    cfg = DiffConfig(
        args.a,
        args.b,
        _mapping_flags(args),
        atol=atol,
        ignore_dtype=args.ignore_dtype,
        memory_budget=size_flag(args.memory_budget, "--memory-budget"),
        as_json=args.json,
        progress=_progress(args),
    )
    out, status = run_diff(cfg)
    if not args.quiet:
        _print(out)
    return status


def _verify(args: argparse.Namespace) -> int:
    out, status = run_verify(VerifyConfig(args.a, args.b, _mapping_flags(args), as_json=args.json))
    if not args.quiet:
        print(out)
    return status


def _silence_stdout() -> None:
    # what is still buffered for the closed pipe would fail again at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": _convert,
    "export": lambda args: _convert(args, "hf"),
    "inspect": _inspect,
    "plan": _plan,
    "diff": _diff,
    "explain": _explain,
    "verify": _verify,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardsync`` command; returns the exit status.

    Example:
        >>> main(["--version"])   # doctest: +ELLIPSIS
        shardsync ...
        0
    """
    p = parser(__version__)
    try:
        args, extra = p.parse_known_args(argv)
        if extra:  # reported by the command's own parser, so that the line names the command
            commands(p)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already printed as one line
        return exc.code if isinstance(exc.code, int) else 0
    command = args.command
    tune_allocator()  # this process owns its allocator: keep freed memory warm (docs/performance.md)
    with command_logging(command, quiet=args.quiet, debug=args.debug), noting_interrupts() as interrupted:
        try:
            return _COMMANDS[command](args)
        except WorkerFailed as exc:
            _print(exc.line, sys.stderr)
            return exc.status
        except BrokenPipeError:  # the reader stopped reading (`shardsync inspect ... | head`)
            _silence_stdout()
            return BROKEN_PIPE
        except SystemExit:
            raise
        except BaseException as exc:  # torch's CheckpointException is not an Exception
            if args.debug:
                traceback.print_exc()
            # Ctrl-C can surface as another error raised where it landed (inside torch or safetensors)
            line, status = one_line(command, KeyboardInterrupt() if interrupted else exc)
            _print(line, sys.stderr)
            return status
