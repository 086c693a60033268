"""The report of ``bench_peers.py``: its table and the targets of issue 17, from the rounds' seconds.

A round is one ``{row: seconds}`` dict holding every job's rows, all measured in that round. Ratios are
medians of per-round ratios (each round's jobs ran back to back, so load from other processes falls
on both sides of a ratio alike), with their range over the rounds. Only the standard library here,
so that the report can be checked from given numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ROWS",
    "LABELS",
    "PULLED",
    "PIECES_CEILING",
    "SHARED_SHARDS",
    "TARGETS",
    "Target",
    "targets",
    "targets_md",
    "report",
]

SHM, TORCHRUN = "shardsync shm", "shardsync shm (torchrun)"
#: What the rows of spawned ranks that each start a session of their own end with.
OWN_SESSIONS = " (spawned, each rank in a session of its own)"
SESSIONS = SHM + OWN_SESSIONS
PADDLE_ONE, PADDLE_MESH = "Paddle full_param", "Paddle full_param, 2-D mesh (h_group, v_group)"
GLOO_CEILING = "ceiling: gloo broadcast of the received bytes"
MEMCPY_CEILING = "ceiling: memcpy of every target, both ranks at once"
#: For reference (no target): the copies of the mapping itself, each rank's pieces into every
#: consumer's target, rows as the mapping cuts them (``bench_peers.pieces``).
PIECES_CEILING = (
    "memcpy of each rank's pieces into every consumer's target (rows as the mapping cuts them), both ranks at once"
)
#: The shared-memory transport as it was before senders wrote into their consumers' targets: every
#: read published by its sender and copied out by each receiver (1.5x the targets' bytes on 2 ranks).
PULLED = "shardsync shm, every read published and copied out by its receivers (no pushing)"
SHARED_SHARDS = "shardsync shm, shards in shared memory"

#: (row, processes, the shardsync row its "x vs shardsync" is against) - the order of the table.
ROWS = [
    ("dropped", 1, "dropped"),
    ("aligned", 1, "dropped"),
    ("never", 1, "dropped"),
    ("tuned", 1, "dropped"),
    (PADDLE_ONE, 1, "dropped"),
    ("memcpy warm", 1, "dropped"),
    ("memcpy fresh", 1, "dropped"),
    (SHM, 2, SHM),
    (PULLED, 2, SHM),
    (SHARED_SHARDS, 2, SHM),
    ("shardsync gloo", 2, SHM),
    ("Paddle full_param, single group", 2, SHM),
    (PADDLE_MESH, 2, SHM),
    ("torch DCP _gather_state_dict", 2, SHM),
    ("torch DCP save + dcp_to_torch_save", 2, SHM),
    ("naive all_gather", 2, SHM),
    (GLOO_CEILING, 2, SHM),
    (MEMCPY_CEILING, 2, SHM),
    (PIECES_CEILING, 2, SHM),
    (SESSIONS, 2, SESSIONS),
    (PADDLE_MESH, 2, SESSIONS),
    (MEMCPY_CEILING + OWN_SESSIONS, 2, SESSIONS),
    (PIECES_CEILING + OWN_SESSIONS, 2, SESSIONS),
    (TORCHRUN, 2, TORCHRUN),
    (PADDLE_MESH, 2, TORCHRUN),
    (f"{GLOO_CEILING} (torchrun)", 2, TORCHRUN),
    (f"{MEMCPY_CEILING} (torchrun)", 2, TORCHRUN),
    (f"{PIECES_CEILING} (torchrun)", 2, TORCHRUN),
]
LABELS = {
    "dropped": "shardsync (reuse='dropped', default)",
    "aligned": "shardsync (defaults), sources in torch's memory (on 64 bytes; numpy's start 16 past)",
    "never": "shardsync (reuse='never')",
    "tuned": "shardsync (reuse='never', tune_allocator())",
    "memcpy warm": "ceiling: memcpy of every target into touched memory",
    "memcpy fresh": "memcpy of every target into fresh memory",
}


@dataclass(frozen=True)
class Target:
    """``ours`` at least ``bound`` times faster than ``other`` (``faster``), or at most ``bound``
    times ``other``'s time (a ceiling: ``faster=False``)."""

    name: str
    ours: str
    other: str
    bound: float
    faster: bool

    def ratio(self, r: dict[str, float]) -> float:
        return r[self.other] / r[self.ours] if self.faster else r[self.ours] / r[self.other]


#: Issue 17's targets for this table.
TARGETS = [
    Target("1 process: >= 2.5x Paddle full_param", "dropped", PADDLE_ONE, 2.5, True),
    Target("2 processes, spawned: >= 4x Paddle's 2-D mesh path", SHM, PADDLE_MESH, 4.0, True),
    Target("2 processes, torchrun: >= 4x Paddle's 2-D mesh path", TORCHRUN, PADDLE_MESH, 4.0, True),
    Target("2 processes, spawned: within 2x of the memcpy ceiling", SHM, MEMCPY_CEILING, 2.0, False),
    Target("2 processes, spawned: within 2x of the transport (gloo broadcast) ceiling", SHM, GLOO_CEILING, 2.0, False),
    Target(
        "2 processes, spawned, shards moved to shared memory first (share_memory_()): within 2x of the memcpy ceiling",
        SHARED_SHARDS,
        MEMCPY_CEILING,
        2.0,
        False,
    ),
    Target(
        "2 processes, torchrun: within 2x of the memcpy ceiling", TORCHRUN, f"{MEMCPY_CEILING} (torchrun)", 2.0, False
    ),
    Target(
        "2 processes, torchrun: within 2x of the transport (gloo broadcast) ceiling",
        TORCHRUN,
        f"{GLOO_CEILING} (torchrun)",
        2.0,
        False,
    ),
]


def targets(rounds: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Each target's status: ``met`` / ``missed`` from the median of its per-round ratios, or ``not
    measured`` when a round lacks either side (``--no-paddle``)."""
    out = []
    for t in TARGETS:
        row: dict[str, Any] = {"target": t.name}
        if not rounds or any(t.ours not in r or t.other not in r for r in rounds):
            out.append(row | {"status": "not measured"})
            continue
        ratios = [t.ratio(r) for r in rounds]
        median = statistics.median(ratios)
        met = median >= t.bound if t.faster else median <= t.bound
        out.append(row | {"status": "met" if met else "missed", "ratio": median, "range": [min(ratios), max(ratios)]})
    return out


def targets_md(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Targets (issue 17)",
        "",
        "Median of the per-round ratios (range over the rounds); for a ceiling, shardsync's time over it.",
        "",
    ]
    for r in rows:
        if r["status"] == "not measured":
            lines.append(f"- {r['target']}: not measured")
        else:
            lo, hi = r["range"]
            lines.append(f"- {r['target']}: **{r['status']}**, {r['ratio']:.2f}x ({lo:.2f}-{hi:.2f}x)")
    return "\n".join(lines) + "\n"


def report(rounds: list[dict[str, float]], doc: dict[str, Any]) -> str:
    """The table (every row present in the rounds), the thread settings of every side, the targets."""
    lines = [
        f"# shardsync vs peers ({doc['date']})",
        "",
        f"Workload: {doc['workload']}. Machine: {doc['machine']}. Conditions: {doc['conditions']}; load "
        f"average after: {doc['load_after']}. {len(rounds)} interleaved rounds, each job the best of "
        f"{doc['repeats']} passes in a fresh process; seconds are medians over the rounds, ratios medians "
        "of per-round ratios (x = row's time / shardsync's: above 1, shardsync is faster; for a ceiling, "
        "how far shardsync is from it is 1 / x).",
        "",
        "Threads of every side (as each job's processes reported them):",
        "",
        *(f"- {job}: {text}" for job, text in doc["threads"].items()),
        "",
        *(f"{note}\n" for note in doc["notes"]),
        "| processes | variant | s (median) | s (range) | x vs shardsync | against |",
        "|---|---|---|---|---|---|",
    ]
    for key, world, ours in ROWS:
        if any(key not in r or ours not in r for r in rounds):
            continue
        secs = [r[key] for r in rounds]
        x = statistics.median(r[key] / r[ours] for r in rounds)
        lines.append(
            f"| {world} | {LABELS.get(key, key)} | {statistics.median(secs):.3f} | "
            f"{min(secs):.3f}-{max(secs):.3f} | {x:.2f} | {LABELS.get(ours, ours)} |"
        )
    return "\n".join(lines) + "\n\n" + targets_md(targets(rounds))
