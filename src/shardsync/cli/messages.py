"""Every failure of a command as one line, ``shardsync <cmd>: <what is wrong> (<how to fix>)``.

Library errors name Python arguments (``overwrite=True``); here they name the command line flags
(``--overwrite``). Errors gathered from several ranks become one line; operating system errors (a
full disk, a read-only directory) say what to do about them. Anything else is a bug: one line that
points to ``--debug``, which shows the traceback.
"""

from __future__ import annotations

import errno
import re

from ..errors import DistributedError, MappingError, ShardsyncError
from .units import human_bytes

__all__ = ["UsageError", "one_line", "printable", "USER_ERROR", "INTERNAL_ERROR", "INTERRUPTED", "BROKEN_PIPE"]

#: Exit status of a user error (a bad flag, input or output), as argparse uses.
USER_ERROR = 2
#: Exit status of an unexpected error (a bug: ``--debug`` shows its traceback).
INTERNAL_ERROR = 3
#: Exit status after Ctrl-C.
INTERRUPTED = 130
#: Exit status when the reader of the output went away (as a shell reports SIGPIPE).
BROKEN_PIPE = 141


class UsageError(ShardsyncError, ValueError):
    """A mistake in the command line: a flag value, or flags that do not go together.

    Example:
        >>> str(UsageError("--nproc 0 is not a number of workers", "give 1 or more"))
        '--nproc 0 is not a number of workers (give 1 or more)'
    """

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what} ({fix})")


# Python argument names in library messages -> the flags that set them.
_FLAGS = [
    (re.compile(p), r)
    for p, r in (
        (r"\boverwrite=True\b", "--overwrite"),
        (r"\bmemory_budget=", "--memory-budget "),
        (r"\bmemory_budget\b", "--memory-budget"),
        (r"\bmax_shard_size=", "--max-shard-size "),
        (r"\bmax_file_size=", "--max-shard-size "),
        (r"\bmax_shard_size\b", "--max-shard-size"),
        (r"\bextra_files or config_from\b", "--config-from"),
        (r"\bconfig_from=", "--config-from "),
        (r"\bconfig_from\b", "--config-from"),
        (r"\bdtype=", "--dtype "),
        (r"(?<![\w.])(\d{4,}) B\b", lambda m: human_bytes(int(m[1]))),
    )
]
# A message's last "; ..." clause is its fix when it starts with one of these words.
_FIX_WORDS = (
    "pass",
    "choose",
    "use",
    "give",
    "write",
    "raise",
    "fix",
    "did you mean",
    "drop",
    "check",
    "add",
    "remove",
    "call",
    "run",
    "rename",
    "map",
    "set",
    "or ",
)
_GENERIC_FIX = {
    "MappingError": "fix the mapping",
    "FormatError": "check the checkpoint path",
    "LayoutError": "check that the checkpoint is complete",
    "PlanError": "check --memory-budget and --nproc",
}
_OS_FIXES = {
    errno.ENOSPC: ("no space left on the device of {f}", "free some space, or write to another directory"),
    errno.EDQUOT: ("disk quota exceeded writing {f}", "free some space, or write to another directory"),
    errno.EROFS: ("{f} is on a read-only file system", "write to another directory"),
    errno.EACCES: ("permission denied: {f}", "check its permissions, or choose another path"),
    errno.EPERM: ("operation not permitted: {f}", "check its permissions, or choose another path"),
    errno.ENOENT: ("{f} does not exist", "check the path"),
    errno.ENOTDIR: ("{f}: a part of the path is a file, not a directory", "check the path"),
    errno.EISDIR: ("{f} is a directory", "check the path"),
}
_LAST_PARENS = re.compile(r"\(([^()]*)\)$")
_ERRNO = re.compile(r"\[Errno (\d+)\] ([^:']+)(?::\s*'([^']*)')?")


def one_line(command: str, exc: BaseException) -> tuple[str, int]:
    """The line to print for ``exc`` raised by ``shardsync <command>``, and the exit status.

    Example:
        >>> one_line("convert", ShardsyncError("out already holds a checkpoint; pass overwrite=True"))
        ('shardsync convert: out already holds a checkpoint (pass --overwrite)', 2)
        >>> one_line("inspect", KeyError("w"))[0]
        "shardsync inspect: KeyError: 'w' (a bug; run with --debug for the traceback)"
    """
    if isinstance(exc, KeyboardInterrupt):
        return f"shardsync {command}: interrupted", INTERRUPTED
    if isinstance(exc, ShardsyncError):
        return f"shardsync {command}: {_user_text(exc)}", USER_ERROR
    os_error = _os_error(exc)
    if os_error is not None:
        return f"shardsync {command}: {os_error}", USER_ERROR
    text = _flat(f"{type(exc).__name__}: {exc}")
    return f"shardsync {command}: {text} (a bug; run with --debug for the traceback)", INTERNAL_ERROR


def _user_text(exc: ShardsyncError) -> str:
    if isinstance(exc, UsageError):
        return str(exc)
    if isinstance(exc, DistributedError):
        return _distributed_text(exc)
    generic = _GENERIC_FIX.get(type(exc).__name__, "check the input")
    if not isinstance(exc, MappingError) or not exc.diagnostics:
        return _with_fix(_flags(_flat(str(exc))), generic)
    d, more = exc.diagnostics[0], len(exc.diagnostics) - 1
    text = f"{d.file + ': ' if d.file else ''}statement {d.index} `{d.text}`, column {d.col + 1}: {d.message}"
    text = _with_fix(_flags("; ".join((text, *d.hints))), generic)
    return text[:-1] + f"; {more} more problem{'s' if more > 1 else ''} after this one)" if more else text


def _distributed_text(exc: DistributedError) -> str:
    messages = {re.sub(r" \(at [^()]*:\d+\)$", "", m) for m in exc.failures.values()}
    ranks = ", ".join(map(str, exc.failures))
    if len(messages) == 1:
        message = messages.pop()
        found = _ERRNO.search(message)
        if found:
            return _os_text(int(found[1]), found[2], found[3]) + f" (on worker {ranks})"
        cls, _, text = message.partition(": ")
        fix = _GENERIC_FIX.get(cls, "see the message of each worker")
        line = _with_fix(_flags(_flat(text if text else cls)), fix)
        return line.removesuffix(")") + f"; on worker {ranks})"
    first = _flat(sorted(messages)[0])
    return f"workers {ranks} failed in {exc.phase!r}, e.g. {_flags(first)} (run with --debug to see each)"


def _os_error(exc: BaseException) -> str | None:
    """The message for an operating system error in ``exc`` or what caused it, if there is one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return _os_text(exc.errno, exc.strerror or "", exc.filename)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def _os_text(code: int, strerror: str, filename: object) -> str:
    f = str(filename) if filename else "a file"
    what, fix = _OS_FIXES.get(code, ("{s}: {f}", "check the path and the disk"))
    return f"{what.format(f=f, s=strerror.strip())} ({fix})"


def _flat(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    if lines[0].endswith(":"):
        return lines[0] + " " + "; ".join(lines[1:])
    return "; ".join(lines)


def _flags(text: str) -> str:
    for pattern, repl in _FLAGS:
        text = pattern.sub(repl, text)
    return text


def _with_fix(text: str, generic: str) -> str:
    what, sep, fix = text.rpartition("; ")
    if sep and fix.lower().startswith(_FIX_WORDS):
        return f"{what} ({fix})"
    last = _LAST_PARENS.search(text)
    return text if last and last[1].lower().startswith(_FIX_WORDS) else f"{text} ({generic})"


# Control characters (C0, DEL, C1) and the invisible format characters that reorder or hide text.
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\xad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]"
)


def printable(text: str, keep: str = "\n\t") -> str:
    """``text`` safe for a terminal: every control or invisible format character but those in ``keep``
    written as its Python escape, so that a tensor name in a checkpoint cannot send escape codes.

    Example:
        >>> print(printable("layers.0.w\x1b[2J\u202e"))
        layers.0.w\\x1b[2J\\u202e
    """

    def escape(m: re.Match[str]) -> str:
        c = m[0]
        return c if c in keep else c.encode("unicode_escape").decode("ascii")

    return _UNPRINTABLE.sub(escape, text)
