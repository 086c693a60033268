"""Would reading a peer's private shards directly (cross-memory attach) beat the shared-memory transport?

The same-host transport (``exec/shm.py``) moves a read with two copies: its sender copies it into a
shared segment, its receiver copies it out into the target. ``process_vm_readv`` (Linux's cross-memory
attach, what MPI's single-copy intra-node transports use) reads another process's memory with one: the
receiver reads the sender's private shard straight into its target. This measures both on two spawned
gloo ranks, each reading the other's shard of the peers workload's size (half of 0.336 GB) at the same
time, into memory already touched:

* ``process_vm_readv``: the peer's shard into the target, in calls of ``--chunk`` bytes;
* ``shm: publish + copy out``: this rank's shard into its (touched) segment, then the peer's segment
  into the target (numpy ``copyto``, the transport's row copy);
* ``memcpy``: the peer's segment into the target alone (the receiver's half of the transport).

Rounds interleave the three, medians are reported; torch's default threads (nothing here sets them;
the copies are single-threaded either way). Where the kernel forbids the read (Yama
``ptrace_scope`` >= 1, a seccomp profile, another user) the results say so. ``--busy`` measures next
to another busy process (bench/busy.py). Writes ``bench/results/cma.{json,md}`` (``cma_busy.*``).
Quick check: ``--mib 16 --rounds 1 --out /tmp/cma``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.exec.shm_segments import SHM_DIR, as_bytes, map_file

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402
import workload as W  # noqa: E402
from bench_convert import _timed  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ROWS = ("process_vm_readv", "shm: publish + copy out", "memcpy")


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _readv() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


def _read_peer(fn: Any, pid: int, addr: int, dst: torch.Tensor, chunk: int) -> None:
    n = dst.numel()
    for off in range(0, n, chunk):
        size = min(chunk, n - off)
        local, remote = _Iovec(dst.data_ptr() + off, size), _Iovec(addr + off, size)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != size:
            raise OSError(ctypes.get_errno(), f"process_vm_readv of process {pid}: {os.strerror(ctypes.get_errno())}")


def _rank(rank: int, store: str, nbytes: int, rounds: int, chunk: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mine = torch.full((nbytes,), rank + 1, dtype=torch.uint8)  # a private shard, as a trainer holds it
    target = torch.zeros(nbytes, dtype=torch.uint8)
    path = os.path.join(SHM_DIR, f"bench-cma-{os.getpid()}")
    segment = as_bytes(map_file(path, nbytes, create=True))  # made as the transport makes its segment
    where: list[Any] = [None, None]
    dist.all_gather_object(where, (os.getpid(), mine.data_ptr(), path))
    pid, addr, peer_path = where[1 - rank]
    peer_segment = as_bytes(map_file(peer_path, nbytes, create=False))
    dist.barrier()
    os.unlink(path)  # both mapped: the names go
    peer_segment.numpy()[:] = 0  # touched, as the transport's kept segments are
    fn = _readv()
    try:
        _read_peer(fn, pid, addr, target[:4096], 4096)
        allowed = ""
    except OSError as exc:
        allowed = str(exc)
    said: list[Any] = [None, None]
    dist.all_gather_object(said, allowed)
    denied = next((s for s in said if s), "")
    times: dict[str, list[float]] = {r: [] for r in ROWS}
    for k in range(rounds):
        jobs = {
            "process_vm_readv": lambda: _read_peer(fn, pid, addr, target, chunk),
            "shm: publish + copy out": lambda: (
                np.copyto(segment.numpy(), mine.numpy()),
                dist.barrier(),
                np.copyto(target.numpy(), peer_segment.numpy()),
            ),
            "memcpy": lambda: np.copyto(target.numpy(), peer_segment.numpy()),
        }
        order = list(ROWS[k % 3 :] + ROWS[: k % 3])
        for name in order:
            if name == "process_vm_readv" and denied:
                continue
            target.zero_()  # outside the window: every row must write the whole target
            times[name].append(_timed(rank, jobs[name]))
            if not bool((target == 2 - rank).all()):  # every row leaves the peer's shard in the target
                raise AssertionError(f"{name}: the target does not hold the peer's shard")
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "denied": denied, "threads": busy.threads()}))
    dist.destroy_process_group()


def markdown(doc: dict[str, Any]) -> str:
    med = doc["seconds"]
    lines = [
        f"# Cross-memory attach against the shared-memory transport ({doc['date']})",
        "",
        f"Two spawned gloo ranks, each reading the other's {doc['bytes'] / 1e9:.3f} GB shard at the same time "
        f"into touched memory; {doc['rounds']} interleaved rounds, medians; {doc['conditions']}; "
        f"process_vm_readv in calls of {doc['chunk'] >> 20} MiB.",
        "",
        "| how a rank gets its peer's shard | s (median) | GB/s per rank | x vs shm publish + copy out |",
        "|---|---|---|---|",
    ]
    base = med.get("shm: publish + copy out")
    for name in ROWS:
        s = med.get(name)
        if s is None:
            lines.append(f"| {name} | not permitted here: {doc['denied']} | | |")
            continue
        lines.append(f"| {name} | {s:.4f} | {doc['bytes'] / s / 1e9:.2f} | {s / base:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, help="MiB of each rank's shard (default: half of bench/workload.py's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=4 << 20, help="bytes per process_vm_readv call")
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    args = ap.parse_args(argv)
    nbytes = args.mib << 20 if args.mib else W.total_bytes(W.full_weights()) // 2
    with tempfile.TemporaryDirectory() as tmp, busy.run(args.busy) as conditions:
        result = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), nbytes, args.rounds, args.chunk, result), nprocs=2)
        got = json.loads(Path(result).read_text())
    doc = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "bytes": nbytes,
        "rounds": args.rounds,
        "chunk": args.chunk,
        "conditions": f"{conditions}; the ranks: {got['threads']}",
        "denied": got["denied"],
        "seconds": {k: round(statistics.median(v), 4) for k, v in got["times"].items() if v},
        "range_seconds": {k: [round(min(v), 4), round(max(v), 4)] for k, v in got["times"].items() if v},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = busy.stem("cma", args.busy)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
