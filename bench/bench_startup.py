"""Start-up: what a command costs before it does any work, against ``python -c "import torch"``.

Jobs, each a fresh process with default thread settings (nothing pinned), timed from start to exit:

* ``import torch`` - the baseline every torch tool pays;
* ``shardsync --version`` and ``shardsync inspect`` of a two-tensor safetensors file;
* ``shardsync convert`` of the same file with ``--nproc 1`` and ``--nproc 2``: the difference is what
  starting the workers (torch's launcher, two spawned interpreters importing torch) costs.

Rounds are interleaved (one of each job per round) and medians reported with the range, so a busy
moment hits every job alike, on a quiet machine and then with another busy process (bench/busy.py:
torch matmuls with default threads). Run: ``.venv/bin/python bench/bench_startup.py [--rounds N]``.
Writes bench/results/startup.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parent))
from busy import busy_process  # noqa: E402


def _jobs(tmp: Path) -> dict[str, list[str]]:
    py = sys.executable
    src = tmp / "small.safetensors"
    return {
        "import torch": [py, "-c", "import torch"],
        "shardsync --version": [py, "-m", "shardsync", "--version"],
        "shardsync inspect": [py, "-m", "shardsync", "inspect", str(src)],
        "convert --nproc 1": [py, "-m", "shardsync", "convert", str(src), str(tmp / "one"), "--overwrite", "--quiet"],
        "convert --nproc 2": [
            py,
            "-m",
            "shardsync",
            "convert",
            str(src),
            str(tmp / "two"),
            "--overwrite",
            "--quiet",
            "--nproc",
            "2",
        ],
    }


def measure(rounds: int) -> dict[str, list[float]]:
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        save_file({"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(3)}, str(tmp / "small.safetensors"))
        jobs = _jobs(tmp)
        times: dict[str, list[float]] = {k: [] for k in jobs}
        for _ in range(rounds):
            for name, cmd in jobs.items():
                start = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    return times


def report(times: dict[str, list[float]], busy: bool) -> list[dict]:
    base = statistics.median(times["import torch"])
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"job": name, "median_s": med, "min_s": min(t), "max_s": max(t), "vs_import_torch": med / base})
    one = statistics.median(times["convert --nproc 1"])
    two = statistics.median(times["convert --nproc 2"])
    rows.append(
        {
            "job": "worker start-up (--nproc 2 minus --nproc 1)",
            "median_s": two - one,
            "min_s": None,
            "max_s": None,
            "vs_import_torch": (two - one) / base,
        }
    )
    for r in rows:
        rng = "" if r["min_s"] is None else f" ({r['min_s']:.2f}-{r['max_s']:.2f})"
        print(
            f"{'busy' if busy else 'quiet'}  {r['job']:44s} {r['median_s']:6.2f} s{rng}  "
            f"{r['vs_import_torch']:.2f}x import torch"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    out: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": "default (none pinned)",
        "rounds": args.rounds,
        "runs": {},
    }
    out["runs"]["quiet"] = report(measure(args.rounds), False)
    with busy_process():
        out["runs"]["busy"] = report(measure(args.rounds), True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps(out, indent=2))
    lines = [
        f"# Start-up ({out['machine']}; threads: {out['threads']}; medians of {args.rounds} interleaved "
        "rounds, range in brackets)",
        "",
        "| job | quiet | busy (one other process running torch matmuls) |",
        "|---|---|---|",
    ]
    for q, b in zip(out["runs"]["quiet"], out["runs"]["busy"]):
        lines.append(
            f"| {q['job']} | {q['median_s']:.2f} s ({q['vs_import_torch']:.2f}x import torch) | "
            f"{b['median_s']:.2f} s ({b['vs_import_torch']:.2f}x) |"
        )
    (RESULTS / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
