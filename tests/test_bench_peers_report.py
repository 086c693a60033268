"""bench/peers_report.py: issue 17's targets from given rounds - the median of per-round ratios, its
range, met / missed against each bound (inclusive), and "not measured" where a side is missing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import peers_report as P  # noqa: E402

MESH = P.PADDLE_MESH
# Powers of two: every ratio below is exact in floating point.
ROUNDS = [
    {"dropped": 0.25, P.PADDLE_ONE: 1.0, P.SHM: 0.25, MESH: 1.0, P.MEMCPY_CEILING: 0.125, P.GLOO_CEILING: 0.0625},
    {"dropped": 0.5, P.PADDLE_ONE: 1.0, P.SHM: 0.125, MESH: 1.0, P.MEMCPY_CEILING: 0.0625, P.GLOO_CEILING: 0.0625},
    {"dropped": 0.125, P.PADDLE_ONE: 0.25, P.SHM: 0.5, MESH: 2.0, P.MEMCPY_CEILING: 0.5, P.GLOO_CEILING: 0.125},
]
for _r, _shared in zip(ROUNDS, (0.25, 0.0625, 1.0)):
    _r[P.SHARED_SHARDS] = _shared


def _target(name: str, status: str, ratio: float, lo: float, hi: float) -> tuple[str, dict]:
    return name, {"target": name, "status": status, "ratio": ratio, "range": [lo, hi]}


def test_targets_from_given_rounds() -> None:
    got = {t["target"]: t for t in P.targets(ROUNDS)}
    assert got == dict(
        [
            # Paddle / shardsync per round: 4, 2, 2 -> median 2 < 2.5
            _target("1 process: >= 2.5x Paddle full_param", "missed", 2.0, 2.0, 4.0),
            # 4, 8, 4 -> median 4: the bound itself is met
            _target("2 processes, spawned: >= 4x Paddle's 2-D mesh path", "met", 4.0, 4.0, 8.0),
            # shardsync / ceiling: 2, 2, 1 -> median 2 <= 2
            _target("2 processes, spawned: within 2x of the memcpy ceiling", "met", 2.0, 1.0, 2.0),
            # 4, 2, 4 -> median 4 > 2
            _target(
                "2 processes, spawned: within 2x of the transport (gloo broadcast) ceiling", "missed", 4.0, 2.0, 4.0
            ),
            # shards in shared memory / ceiling: 2, 1, 2 -> median 2 <= 2
            _target(
                "2 processes, spawned, shards moved to shared memory first (share_memory_()): within 2x of the "
                "memcpy ceiling",
                "met",
                2.0,
                1.0,
                2.0,
            ),
            # no torchrun job in these rounds
            *(
                (name, {"target": name, "status": "not measured"})
                for name in (
                    "2 processes, torchrun: >= 4x Paddle's 2-D mesh path",
                    "2 processes, torchrun: within 2x of the memcpy ceiling",
                    "2 processes, torchrun: within 2x of the transport (gloo broadcast) ceiling",
                )
            ),
        ]
    )


def test_a_side_missing_in_one_round_is_not_measured() -> None:
    rounds = [dict(r) for r in ROUNDS]
    del rounds[1][P.PADDLE_ONE]
    got = {t["target"]: t["status"] for t in P.targets(rounds)}
    assert got["1 process: >= 2.5x Paddle full_param"] == "not measured"
    assert got["2 processes, spawned: >= 4x Paddle's 2-D mesh path"] == "met"


def test_report_lines() -> None:
    doc = {
        "date": "d",
        "workload": "w",
        "machine": "m",
        "conditions": "c",
        "load_after": "l",
        "repeats": 1,
        "threads": {"shardsync, 1 process": "torch threads 2 (OMP_NUM_THREADS unset)"},
        "notes": [],
    }
    text = P.report(ROUNDS, doc)
    assert "- shardsync, 1 process: torch threads 2 (OMP_NUM_THREADS unset)\n" in text
    # seconds: median and range over the rounds; x: median of the per-round ratios to shardsync
    assert "| 1 | Paddle full_param | 1.000 | 0.250-1.000 | 2.00 | shardsync (reuse='dropped', default) |\n" in text
    assert "torchrun" not in text.split("## Targets")[0]  # rows without a torchrun job are left out
    assert "- 1 process: >= 2.5x Paddle full_param: **missed**, 2.00x (2.00-4.00x)\n" in text
    assert "- 2 processes, torchrun: within 2x of the memcpy ceiling: not measured\n" in text
