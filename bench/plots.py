"""Draw the benchmark results as PNGs (matplotlib, from the ``bench`` extra).

* ``scaling_bytes.png``: seconds against GB streamed (2 ranks), one line per strategy, ceilings dashed;
* ``scaling_world.png``: seconds against ranks (4 layers), likewise;
* ``peers.png``: the peers table (``peers.json``) as bars, when it exists.

Run: ``python bench/plots.py`` after ``bench_scaling.py`` (``make bench`` does both).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["main", "plot_scaling", "plot_peers"]

RESULTS = Path(__file__).parent / "results"


def _series(configs: list[dict], axis: str, fixed: tuple[str, int]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for c in configs:
        if c[fixed[0]] != fixed[1] and not (axis == "world" and c["world"] == 1 and c["layers"] == fixed[1]):
            continue
        x = c["bytes"] / 1e9 if axis == "bytes" else c["world"]
        for name, secs in c["seconds"].items():
            name = "shm" if name == "local" else name  # one rank: the local copy continues the shm line
            out.setdefault(name, []).append((x, secs))
    return {k: sorted(v) for k, v in out.items()}


def plot_scaling(doc: dict[str, Any], out: Path) -> list[Path]:
    """Two PNGs from ``scaling.json``; returns their paths."""
    made = []
    for axis, fixed, label, name in (
        ("bytes", ("world", 2), "GB of targets per rank (2 ranks)", "scaling_bytes.png"),
        ("world", ("layers", 4), "ranks (4 layers, 0.168 GB)", "scaling_world.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for series, points in _series(doc["configs"], axis, fixed).items():
            xs, ys = zip(*points)
            style = "--" if series.startswith("ceiling") else "-"
            ax.plot(xs, ys, style, marker="o", label=series, linewidth=2.5 if series == "shm" else 1.2)
        ax.set_xlabel(label)
        ax.set_ylabel(f"seconds (slowest rank, best of {doc['repeats']})")
        ax.set_title(f"full_params, every rank receives every target ({doc['date'][:10]})")
        if axis == "world":
            ax.set_xticks(sorted({c["world"] for c in doc["configs"]}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(out / name)
    return made


def plot_peers(doc: dict[str, Any], out: Path) -> Path:
    """Bars of the median seconds of every row of ``peers.json``, in the table's order."""
    sys.path.insert(0, str(Path(__file__).parent))
    from peers_report import LABELS, ROWS

    rounds = doc["rounds"]
    rows = list(dict.fromkeys((key, world) for key, world, _ in ROWS if all(key in r for r in rounds)))
    secs = [statistics.median(r[key] for r in rounds) for key, _ in rows]
    names = [f"{world} proc: {LABELS.get(key, key)}" for key, world in rows]
    colors = [
        "tab:gray" if "ceiling" in n or "memcpy" in n else "tab:green" if "shardsync" in n else "tab:blue"
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    ax.barh(range(len(rows)), secs, color=colors)
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median over rounds); green: shardsync, blue: peers, gray: ceilings")
    ax.set_title(f"shardsync vs peers ({doc['date'][:10]})\n{doc['workload']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=110, bbox_inches="tight")  # the long labels whole
    plt.close(fig)
    return out / "peers.png"


def main(argv: list[str] | None = None) -> list[Path]:
    out = Path(argv[0]) if argv else RESULTS
    made = []
    if (out / "scaling.json").exists():
        made += plot_scaling(json.loads((out / "scaling.json").read_text()), out)
    if (out / "peers.json").exists():
        made.append(plot_peers(json.loads((out / "peers.json").read_text()), out))
    for p in made:
        print(f"wrote {p}")
    return made


if __name__ == "__main__":
    main(sys.argv[1:])
