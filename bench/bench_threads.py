"""Copies with default threads, on a quiet machine and next to one busy process (issue: speed that holds).

The single-process export of ``bench_export.py`` (0.336 GB fp32: fused QKV and gate/up split, one
transpose per layer, renames) with torch's DEFAULT thread settings (``torch.get_num_threads()`` as a
user gets it; OMP_NUM_THREADS unset), measured two ways in the same run, interleaved:

* ``shardsync``: as shipped, copies on shardsync's own copy threads (``exec/copies.py``);
* ``shardsync, torch copy_``: the same with every copy a plain ``copy_`` on torch's intra-op threads
  (what shardsync did before ``exec/copies.py``);
* ``memcpy, torch copy_``: ``torch.empty_like(x).copy_(x)`` of every source, default threads (the
  ceiling a user measures with torch alone).

Each is run once on the quiet machine and once with another busy process (a second Python process
running torch matmuls with its own default threads, as a trainer or a data loader next to it
would): it runs both itself, so it has no ``--busy``. Medians of 7 interleaved rounds (``--rounds``);
ratios are medians of per-round ratios. Writes bench/results/threads.{json,md} (or ``--out``). Run:
``.venv/bin/python bench/bench_threads.py``; ``--rounds 1 --out /tmp/x`` for a quick check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import shardsync
from shardsync.exec import assemble, copies, executor, shm

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402
from bench_export import MAPPING, build_state  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _export(state: dict[str, torch.Tensor]) -> None:
    for _ in shardsync.full_params(state, MAPPING):
        pass


_USERS = (assemble, executor, shm)  # the modules that copy through copies.copy_into


def _torch_copies(state: dict[str, torch.Tensor]) -> None:
    for module in _USERS:
        module.copy_into = _plain  # type: ignore[attr-defined]
    try:
        _export(state)
    finally:
        for module in _USERS:
            module.copy_into = copies.copy_into  # type: ignore[attr-defined]


def _plain(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _memcpy(state: dict[str, torch.Tensor]) -> None:
    for v in state.values():
        torch.empty_like(v).copy_(v)


VARIANTS = {"shardsync": _export, "shardsync, torch copy_": _torch_copies, "memcpy, torch copy_": _memcpy}


def _rounds(state: dict[str, torch.Tensor], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(rounds):
        for name, fn in VARIANTS.items():
            t0 = time.perf_counter()
            fn(state)
            times[name].append(time.perf_counter() - t0)
    return times


def _summary(times: dict[str, list[float]]) -> dict[str, object]:
    ours = times["shardsync"]
    out: dict[str, object] = {f"{k} median s": round(statistics.median(v), 4) for k, v in times.items()}
    out.update({f"{k} range s": f"{min(v):.3f}-{max(v):.3f}" for k, v in times.items()})
    for k in ("shardsync, torch copy_", "memcpy, torch copy_"):
        out[f"speed-up vs {k}"] = round(statistics.median(b / a for a, b in zip(ours, times[k])), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    state = build_state()
    _export(state)  # warm up: plan cache, pool, first-touch pages
    results: dict[str, object] = {
        "torch threads": torch.get_num_threads(),
        "copy threads": copies.copy_threads(),
        "cores": len(os.sched_getaffinity(0)),
        "state GB": round(sum(v.nbytes for v in state.values()) / 1e9, 3),
    }
    with busy.run(False) as quiet_conditions:
        results["quiet"] = _summary(_rounds(state, a.rounds))
    with busy.run(True) as busy_conditions:
        results["one busy process"] = _summary(_rounds(state, a.rounds))
    results["conditions"] = {"quiet": quiet_conditions, "one busy process": busy_conditions}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "threads.json").write_text(json.dumps(results, indent=2) + "\n")
    md = [
        f"export of {results['state GB']} GB fp32, 1 process, torch default threads "
        f"({results['torch threads']}), shardsync copy threads {results['copy threads']}, "
        f"{results['cores']} cores; medians of {a.rounds} interleaved rounds",
        "",
        f"- quiet: {quiet_conditions}",
        f"- one busy process: {busy_conditions}",
        "",
        "| measure | quiet | one busy process |",
        "|---|---|---|",
    ]
    quiet, busy_res = results["quiet"], results["one busy process"]
    assert isinstance(quiet, dict) and isinstance(busy_res, dict)
    md += [f"| {k} | {quiet[k]} | {busy_res[k]} |" for k in quiet]
    (a.out / "threads.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
