"""Every example in README.md and docs/*.md runs as written (test tier 1, plus spawned ranks).

Per markdown file, its fenced blocks run in order in one temporary working directory, sharing one
namespace, like a notebook:

* ```` ```python ```` blocks are executed. A block right after the comment ``<!-- ranks: N -->`` runs
  on N processes set up the way ``torchrun --nproc_per_node N`` sets them up (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), so ``dist.init_process_group("gloo")`` works as
  written; such a block must be self-contained. The processes of one world size are started once
  for the whole file (:class:`rank_pool.RankPool`); each block makes and ends its own group.
* A ```` ```text ```` block right after the comment ``<!-- output -->`` is what the python block before
  it prints, compared line by line (trailing spaces ignored).
* ```` ```sh ```` blocks: each ``shardsync ...`` line runs as the command line tool, other lines in the
  shell (exit status 0 unless the line ends with ``# exit N``); ``make``/``pip``/``torchrun`` lines
  are set-up and covered by their own tests (``make demo`` by test_demo.py). A ``shardsync`` line
  runs in this process (``shardsync.cli.main``, what the command calls; a new interpreter per line
  cost most of this file's time) unless it needs the shell or a new process: shell syntax (pipes,
  redirections, variables, globs) or ``--nproc`` (workers) run it as ``python -m shardsync``. The
  command's own process (entry point, exit status, Ctrl-C) is tested by test_cli*.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from multiproc import free_port
from rank_pool import RankPool

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose examples another test runs (a page written as one script across ranks), by that test.
RUN_ELSEWHERE = {"replicas.md": "test_replicas_docs.py"}
FILES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in RUN_ELSEWHERE)]
ELSEWHERE = re.compile(r"(?:executed by|runs as is in|run by) (tests/\S+)")
FENCE = re.compile(
    r"(?P<marker><!--\s*(?P<what>[^>]*?)\s*-->\s*\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```\s*$", re.S | re.M
)
SETUP_COMMANDS = ("make", "pip", "torchrun", "python", "cd", "git")


def _blocks(path: Path) -> list[tuple[str, str, str]]:
    """``(lang, marker, body)`` of every fenced block at the top level of the file."""
    return [(m["lang"], m["what"] or "", m["body"]) for m in FENCE.finditer(path.read_text())]


def _as_torchrun(rank: int, world: int, code: str, port: int, cwd: str) -> str:
    # the example makes its own group, as under torchrun (the pool ends one it leaves open)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.chdir(cwd)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"<rank {rank} example>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def _in_process(line: str, argv: list[str]) -> bool:
    """Whether a ``shardsync`` line can run as ``main(argv)``: no shell syntax, no worker processes."""
    tokens = list(shlex.shlex(line, posix=True, punctuation_chars=True))
    shell = any(set(t) <= set("();<>|&") for t in tokens) or set(line) & set("$`*?~")
    return argv[0] == "shardsync" and not shell and "--nproc" not in argv


def _main(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    from shardsync.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)  # as the shell runs it (contextlib.chdir is Python 3.11+)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    finally:
        os.chdir(here)
    return status, out.getvalue(), err.getvalue()


def _run_sh(body: str, cwd: Path) -> None:
    for raw in body.splitlines():
        line, _, comment = raw.partition(" #")
        line = line.strip()
        if not line or line.startswith("#") or line.split()[0] in SETUP_COMMANDS:
            continue
        status = re.match(r"\s*exit (\d+)", comment)
        expect = int(status[1]) if status else 0
        argv = shlex.split(line)
        if _in_process(line, argv):
            code, out, err = _main(argv[1:], cwd)
        else:
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            command: list[str] | str = (
                [sys.executable, "-m", "shardsync", *argv[1:]] if argv[0] == "shardsync" else line
            )  # other lines: the shell
            done = subprocess.run(
                command, cwd=cwd, env=env, shell=isinstance(command, str), capture_output=True, text=True, timeout=300
            )
            code, out, err = done.returncode, done.stdout, done.stderr
        assert code == expect, f"`{line}` exited {code}:\n{out}\n{err}"
        assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, RankPool]]:
    """Rank processes by world size, shared by every page's examples."""
    made: dict[int, RankPool] = {}
    yield made
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pools: dict[int, RankPool]) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    printed = ""
    ran = 0
    for lang, marker, body in _blocks(path):
        other = ELSEWHERE.search(marker)
        if other:  # a test of its own runs this block: make sure it exists and reads this page
            assert path.name in (ROOT / other[1]).read_text(), f"{other[1]} does not run {path.name}"
            ran += 1
            continue
        if lang == "python":
            ranks = re.fullmatch(r"ranks:\s*(\d+)", marker)
            if ranks:
                world = int(ranks[1])
                pool = pools.setdefault(world, RankPool(world))
                outs = pool.run(_as_torchrun, body, free_port(), str(tmp_path), timeout=240)
                printed = outs[0]
            else:
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    exec(compile(body, f"<{path.name} example>", "exec"), namespace)
                printed = out.getvalue()
            ran += 1
        elif lang == "text" and marker == "output":
            got = [line.rstrip() for line in printed.strip("\n").splitlines()]
            want = [line.rstrip() for line in body.strip("\n").splitlines()]
            assert got == want, f"{path.name}: printed\n" + "\n".join(got)
        elif lang == "sh":
            _run_sh(body, tmp_path)
            ran += 1
    assert ran or not _blocks(path), f"{path.name}: no runnable example"


@pytest.mark.parametrize("page, test", sorted(RUN_ELSEWHERE.items()))
def test_pages_run_elsewhere_are_run(page: str, test: str) -> None:
    assert page in (ROOT / "tests" / test).read_text()


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_pages_stand_on_their_own(path: Path) -> None:
    # user docs ship with the repository: no link or path outside it
    assert "../shared" not in path.read_text() and "shared/design" not in path.read_text()
