"""Start-up: what a command costs before it does any work, against ``python -c "import torch"``.

Jobs, each a fresh process with default thread settings (nothing pinned), timed from start to exit:

* ``import torch`` - the baseline every torch tool pays;
* ``shardsync --version`` and ``shardsync inspect`` of a two-tensor safetensors file;
* ``shardsync convert`` of the same file with ``--nproc 1`` and ``--nproc 2``, the workers forked (as
  the command starts them on Linux) and spawned (``SHARDSYNC_START_METHOD=spawn``: two new interpreters
  importing torch): the difference to ``--nproc 1`` is what starting the workers costs (torch's
  launcher and the workers' start).

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
from shardsync.cli.launch import START_METHOD_ENV  # noqa: E402


def _jobs(tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each job's command line and the environment it runs in."""
    py = sys.executable
    src = tmp / "small.safetensors"
    convert = [py, "-m", "shardsync", "convert", str(src), str(tmp / "out"), "--overwrite", "--quiet"]
    forked = {**os.environ, START_METHOD_ENV: ""}
    return {
        "import torch": ([py, "-c", "import torch"], forked),
        "shardsync --version": ([py, "-m", "shardsync", "--version"], forked),
        "shardsync inspect": ([py, "-m", "shardsync", "inspect", str(src)], forked),
        "convert --nproc 1": (convert, forked),
        "convert --nproc 2, forked": ([*convert, "--nproc", "2"], forked),
        "convert --nproc 2, spawned": ([*convert, "--nproc", "2"], {**forked, START_METHOD_ENV: "spawn"}),
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
            for name, (cmd, env) in jobs.items():
                start = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True, env=env)
                times[name].append(time.perf_counter() - start)
    return times


def report(times: dict[str, list[float]], busy: bool) -> list[dict]:
    base = statistics.median(times["import torch"])
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"job": name, "median_s": med, "min_s": min(t), "max_s": max(t), "vs_import_torch": med / base})
    one = statistics.median(times["convert --nproc 1"])
    for how in ("forked", "spawned"):
        two = statistics.median(times[f"convert --nproc 2, {how}"])
        rows.append(
            {
                "job": f"worker start-up, {how} (--nproc 2 minus --nproc 1)",
                "median_s": two - one,
                "min_s": None,
                "max_s": None,
                "vs_import_torch": (two - one) / base,
            }
        )
    for r in rows:
        rng = "" if r["min_s"] is None else f" ({r['min_s']:.2f}-{r['max_s']:.2f})"
        print(
            f"{'busy' if busy else 'quiet'}  {r['job']:52s} {r['median_s']:6.2f} s{rng}  "
            f"{r['vs_import_torch']:.2f}x import torch"
        )
    return rows


def _loads() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _cell(r: dict, ratio: str) -> str:
    rng = "" if r["min_s"] is None else f", {r['min_s']:.2f}-{r['max_s']:.2f}"
    return f"{r['median_s']:.2f} s ({r['vs_import_torch']:.2f}x{ratio}{rng})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    out: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": "default (none pinned)",
        "rounds": args.rounds,
        "runs": {},
        "load_average": {},  # 1, 5 and 15 min, at the start and the end of each run
    }
    start = _loads()
    out["runs"]["quiet"] = report(measure(args.rounds), False)
    out["load_average"]["quiet"] = [start, _loads()]
    with busy_process():
        start = _loads()
        out["runs"]["busy"] = report(measure(args.rounds), True)
        out["load_average"]["busy"] = [start, _loads()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps(out, indent=2))
    loads = out["load_average"]
    lines = [
        f"# Start-up ({out['date']}; {out['machine']}; threads: {out['threads']}; medians of {args.rounds} "
        "interleaved rounds, then the ratio to import torch and the range)",
        "",
        f"Load average (1, 5, 15 min) at the start and end: quiet run {loads['quiet'][0]} / {loads['quiet'][1]}; "
        f"busy run {loads['busy'][0]} / {loads['busy'][1]} (the machine is shared: other processes ran).",
        "",
        "| job | quiet (no busy process started; others ran, see the load average) "
        "| busy (one other process running torch matmuls) |",
        "|---|---|---|",
    ]
    for q, b in zip(out["runs"]["quiet"], out["runs"]["busy"]):
        lines.append(f"| {q['job']} | {_cell(q, ' import torch')} | {_cell(b, '')} |")
    (RESULTS / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
