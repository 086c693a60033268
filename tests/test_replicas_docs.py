"""docs/replicas.md runs as written: its Python blocks, in order, are one script, run on 2 gloo ranks
(the process group is already up, as under torchrun), and a text block right after a Python block is
that block's output, the same on every rank (``...`` elides, as in doctests)."""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from pathlib import Path

from multiproc import run_ranks

DOC = Path(__file__).resolve().parent.parent / "docs" / "replicas.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def _blocks(text: str) -> list[tuple[str, int, str | None]]:
    """(source, first line, expected output or None) per Python block."""
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        follows = nxt is not None and nxt.group(1) == "text" and not text[m.end() : nxt.start()].strip()
        line = text.count("\n", 0, m.start()) + 2
        out.append((m.group(2), line, nxt.group(2) if follows else None))  # type: ignore[union-attr]
    return out


def _run(rank: int, world: int, sources: list[tuple[str, int]]) -> list[str]:
    import torch.distributed as dist

    namespace: dict = {"__name__": "__main__"}
    outputs = []
    real_init = dist.init_process_group
    dist.init_process_group = lambda backend=None, **kw: None  # run_ranks joined the ranks already
    try:
        for source, line in sources:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = compile("\n" * (line - 1) + source, str(DOC), "exec")  # tracebacks: doc lines
                exec(code, namespace)
            outputs.append(buf.getvalue())
    finally:
        dist.init_process_group = real_init
    return outputs


def test_doc_examples_run_and_print_what_they_show() -> None:
    blocks = _blocks(DOC.read_text())
    assert len(blocks) >= 8 and sum(b[2] is not None for b in blocks) >= 6
    outputs = run_ranks(_run, 2, [(src, line) for src, line, _ in blocks], timeout=180)
    assert outputs[0] == outputs[1]
    checker = doctest.OutputChecker()
    wrong = [
        f"block at docs/replicas.md:{line} printed:\n{got}the doc shows:\n{expected or ''}"
        for (_, line, expected), got in zip(blocks, outputs[0])
        if not checker.check_output(expected or "", got, doctest.ELLIPSIS)
    ]
    assert not wrong, "\n".join(wrong)
