"""gloo's send and recv take host memory only (a GPU tensor's pointer handed to its socket fails with
"Bad address"): the p2p transport sends and receives GPU tensors through host copies, received ones
copied into their GPU buffers after the wait. The GPU check runs that for real; here every buffer is
staged (``P2PTransport.stages`` answering yes), so the same path runs on CPU tensors: every value
arrives through a host copy, into packet buffers and straight into targets alike (tier 2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from multiproc import run_ranks
from reference import arange_tensor
from shardsync import LocalShard, load
from shardsync.exec import transport as T
from shardsync.layout import shard_dim
from shardsync.stream import full_params


def _staging_everything() -> list[int]:
    """Make every p2p buffer of this process travel through a host copy; returns the list the staged
    buffers' byte counts are appended to (sends and receives)."""
    staged: list[int] = []
    wire = T.P2PTransport._wire

    def counted(self: T.P2PTransport, buf: torch.Tensor, posted: T.Posted, receive: bool) -> torch.Tensor:
        out = wire(self, buf, posted, receive)
        if out.data_ptr() != buf.data_ptr():
            staged.append(buf.numel())
        return out

    T.P2PTransport.stages = lambda self, buf: True  # type: ignore[method-assign]
    T.P2PTransport._wire = counted  # type: ignore[method-assign]
    return staged


def _worker(rank: int, world: int) -> dict:
    staged = _staging_everything()
    full = {"a": arange_tensor((17, 3)), "b": arange_tensor((5, 13), start=1000).to(torch.bfloat16)}
    state = {"a": shard_dim(full["a"], 0, rank, world), "b": shard_dim(full["b"], 1, rank, world)}
    out = dict(full_params(state, ["a^T -> a_t", "b -> b"], strategy="p2p", transport="backend"))
    streamed = torch.equal(out["a_t"], full["a"].T) and torch.equal(out["b"], full["b"])
    after_stream = len(staged)
    # load: a peer's half of a row-sharded target lands straight in this rank's shard
    dst = {"a": shard_dim(torch.zeros(17, 3), 0, rank, world)}
    src = {"a": shard_dim(full["a"], 0, 1 - rank, world)}  # each rank holds the other's half
    load(dst, src, group=dist.group.WORLD, transport="backend", strategy="p2p")
    want = shard_dim(full["a"], 0, rank, world)
    assert isinstance(dst["a"], LocalShard) and isinstance(want, LocalShard)
    loaded = torch.equal(dst["a"].local, want.local)
    return {
        "streamed": streamed,
        "loaded": loaded,
        "stream staged": after_stream,
        "load staged": len(staged) - after_stream,
    }


def test_every_buffer_through_a_host_copy_arrives_exactly() -> None:
    for res in run_ranks(_worker, 2):
        assert res["streamed"] and res["loaded"]
        assert res["stream staged"] >= 2 and res["load staged"] >= 2  # sends and receives went through copies
