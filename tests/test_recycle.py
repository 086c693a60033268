"""Target memory recycling (shardsync.exec.memory): a kept tensor is never overwritten.

A stream of many same-size targets reuses the memory of targets the caller dropped (``reuse="dropped"``,
the default). Whatever the caller keeps - the tensor, a view, its storage, a numpy array or a DLPack
capsule of it - keeps its block out of reuse, and every kept target still holds its exact values when
the stream ends. ``"until-next"`` reuses a target's memory once the next one is requested; ``"never"``
does not reuse at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardsync.exec.memory as memory
from multiproc import run_ranks
from reference import arange_tensor
from shardsync.exec.memory import BlockPool, release_memory, tune_allocator
from shardsync.layout import shard_dim
from shardsync.stream import full_params

N = 9  # targets of one size; odd sizes catch a block handed out for the wrong shape
FULL = {f"w{i}": arange_tensor((17, 5), start=1000 * i, step=0.5) for i in range(N)}
MAPPING = [f"w{i}^T -> t{i}" for i in range(N)]  # a transpose: always copied into a fresh target
REF = {f"t{i}": FULL[f"w{i}"].T for i in range(N)}


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    release_memory()  # each test starts without blocks left by another
    monkeypatch.setattr(memory, "POOL_MIN_BYTES", 0)  # these targets are tiny: pool them all


KEEPERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "tensor": lambda t: t,
    "view": lambda t: t[1:, 2:],
    "storage": lambda t: t.untyped_storage(),
    "numpy": lambda t: t.numpy(),
    "dlpack": lambda t: torch.utils.dlpack.to_dlpack(t),
}


def as_tensor(kept: Any, like: torch.Tensor) -> torch.Tensor:
    """Read a kept reference back as the target it came from."""
    if isinstance(kept, torch.UntypedStorage):
        return torch.empty(0, dtype=like.dtype).set_(kept, 0, like.shape)
    if type(kept).__name__ == "PyCapsule":
        return torch.utils.dlpack.from_dlpack(kept)
    if not isinstance(kept, torch.Tensor):
        return torch.from_numpy(kept)
    return kept


@pytest.mark.parametrize("how", sorted(KEEPERS))
def test_kept_targets_are_never_overwritten(how: str) -> None:
    kept: dict[str, Any] = {}
    ptrs = []
    stream = full_params(FULL, MAPPING)
    for i, (name, t) in enumerate(stream):
        ptrs.append(t.data_ptr())
        if i % 2 == 0:  # keep every other target, in one form or another; drop the rest
            kept[name] = KEEPERS[how](t)
    assert stream.stats.reused_blocks > 0  # the dropped ones were recycled
    for name, ref in REF.items():
        if name in kept:
            got = as_tensor(kept[name], ref)
            want = ref if how != "view" else ref[1:, 2:]
            assert torch.equal(got, want), name
    kept_ptrs = {ptrs[i] for i in range(0, N, 2)}
    assert len(kept_ptrs) == len(range(0, N, 2))  # no two kept targets share memory


def test_dropped_targets_are_recycled_and_correct() -> None:
    seen, ptrs = {}, set()
    stream = full_params(FULL, MAPPING)
    for name, t in stream:
        seen[name] = t.clone()  # a copy: the target itself is dropped
        ptrs.add(t.data_ptr())
    assert all(torch.equal(seen[n], REF[n]) for n in REF)
    assert len(ptrs) < N and stream.stats.reused_blocks == N - len(ptrs)
    assert stream.stats.transport == "local"


def test_until_next_reuses_a_kept_target_and_never_does_not() -> None:
    kept = [t for _, t in full_params(FULL, MAPPING, reuse="until-next")]
    assert len({t.data_ptr() for t in kept}) < N  # valid until the next target only, as documented
    fresh = [(n, t) for n, t in full_params(FULL, MAPPING, reuse="never")]
    assert len({t.data_ptr() for _, t in fresh}) == N
    assert all(torch.equal(t, REF[n]) for n, t in fresh)


def test_until_next_never_gives_up_a_callers_source_yielded_as_a_view() -> None:
    # targets kept from one stream (pooled blocks) are the sources of the next; with copy=False, x is
    # a view of a1: "until-next" must not hand a1's block out for y and z
    a = arange_tensor((301, 1000), step=0.5)
    kept = dict(full_params({"a": a}, ["a -> a1, a2, axis=1"]))
    for name, t in full_params(kept, ["a1 -> x", "a2^T -> y", "a1^T -> z"], copy=False, reuse="until-next"):
        ref = {"x": a[:, :500], "y": a[:, 500:].T, "z": a[:, :500].T}[name]
        assert torch.equal(t, ref), name
    assert torch.equal(kept["a1"], a[:, :500]) and torch.equal(kept["a2"], a[:, 500:])


def test_pool_hands_out_exact_storages() -> None:
    pool = BlockPool(1 << 20)
    a = pool.empty((17, 5), torch.float32)
    assert a._base is None and a.untyped_storage().nbytes() == 17 * 5 * 4 and a.is_contiguous()
    ptr = a.data_ptr()
    del a
    b = pool.empty((5, 17), torch.float32)  # same bytes, other shape: reused
    c = pool.empty((85,), torch.int32)  # same bytes, b still alive: fresh
    assert b.data_ptr() == ptr != c.data_ptr() and pool.reused == 1
    big = BlockPool(1 << 20)
    memory.POOL_MIN_BYTES = 1000  # under it: plain torch.empty, not pooled
    assert big.empty((17, 5), torch.float32).untyped_storage().nbytes() == 340 and big.held == 0
    memory.POOL_MIN_BYTES = 0
    small = BlockPool(100)  # too small to keep a 340 B block: every allocation is fresh
    d = small.empty((85,), torch.float32)
    assert small.held == 0 and d.numel() == 85


@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_pooled_targets_own_their_bytes_and_hold_their_block(shm: bool, dtype: torch.dtype) -> None:
    pool = BlockPool(1 << 20, shm=shm)
    a = pool.empty((17, 5), dtype)
    assert a._base is None and a.untyped_storage().nbytes() == 85 * dtype.itemsize and a.is_contiguous()
    assert a.dtype == dtype and a.shape == (17, 5)
    a.view(torch.uint8).view(-1).copy_(torch.arange(85 * dtype.itemsize, dtype=torch.uint8))
    b = pool.empty((5, 17), dtype)  # a is alive: its block is busy
    assert b.data_ptr() != a.data_ptr() and pool.reused == 0
    assert a.view(torch.uint8).reshape(-1).tolist() == [i % 256 for i in range(85 * dtype.itemsize)]
    ptr = a.data_ptr()
    del a
    assert pool.empty((85,), dtype).data_ptr() == ptr and pool.reused == 1


def test_a_pooled_tensor_starts_where_asked_and_its_block_is_found_from_it() -> None:
    pool = BlockPool(1 << 20)
    a = pool.empty((17, 5), torch.float32, align=16)
    assert a.data_ptr() % memory.ALIGN == 16 and a.untyped_storage().nbytes() == 340 and a._base is None
    assert pool.holds(a) and pool.holds(a[3:])
    start = a.data_ptr() - 16
    del a
    b = pool.empty((5, 17), torch.int32, align=40)  # the same block, its tensor elsewhere in it
    assert b.data_ptr() == start + 40 and pool.reused == 1
    pool.release(b)  # "until-next": the caller gave it up, found by its tensor
    assert pool.empty((85,), torch.float32, align=2).data_ptr() == start  # not a multiple of 4 bytes: on 64
    assert pool.empty((170,), torch.bfloat16, align=2).data_ptr() % memory.ALIGN == 2  # busy: a fresh block
    assert BlockPool(1 << 20, shm=True).empty((85,), torch.float32, align=16).data_ptr() % 4096 == 0


def _at(shape: tuple[int, int], align: int, start: int) -> torch.Tensor:
    """``arange_tensor(shape)`` in memory that starts ``align`` bytes past a multiple of 64 (numpy
    arrays start 16 bytes past one; torch's tensors on one)."""
    nbytes = shape[0] * shape[1] * 4
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    out = raw[align : align + nbytes].view(torch.float32).view(shape)
    out.copy_(arange_tensor(shape, start=start, step=0.5))
    assert out.data_ptr() % 64 == align
    return out


@pytest.mark.parametrize("reuse", ["dropped", "until-next"])
def test_a_target_starts_as_its_largest_piece_from_the_source_does(reuse: str) -> None:
    # a's halves start 0 and 2000 bytes into its rows (2000 = 31 x 64 + 16); bc's largest piece, c,
    # starts 101 rows (404,000 bytes = 6312 x 64 + 32) into it; a^T and a cast copy on 64 bytes.
    full = {"a": _at((301, 1000), 24, 0), "b": _at((101, 1000), 56, 7), "c": _at((200, 1000), 40, 9)}
    mapping = ["a -> a1, a2, axis=1", "b, c -> bc, axis=0", "a^T -> at", "a -> half, dtype='bfloat16'"]
    ref = {
        "a1": full["a"][:, :500],
        "a2": full["a"][:, 500:],
        "bc": torch.cat([full["b"], full["c"]]),
        "at": full["a"].T,
        "half": full["a"].to(torch.bfloat16),
    }
    starts = {"a1": 24, "a2": 40, "bc": 8, "at": 0, "half": 0}
    for name, t in full_params(full, mapping, reuse=reuse):  # type: ignore[arg-type]
        assert torch.equal(t, ref[name]), name
        assert t.data_ptr() % memory.ALIGN == starts[name], name
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_bad_reuse_is_rejected() -> None:
    with pytest.raises(ValueError, match="reuse='sometimes': use one of"):
        full_params(FULL, reuse="sometimes")  # type: ignore[arg-type]


def test_allocator_tuning_is_accepted_by_glibc() -> None:
    assert tune_allocator() is True


def _two_ranks(rank: int, world: int) -> dict:
    memory.POOL_MIN_BYTES = 0  # a spawned process: the fixture's patch does not reach it
    state = {k: shard_dim(v, 0, rank, world) for k, v in FULL.items()}
    out = {}
    for transport in ("backend", "shm"):
        kept, reused = {}, 0
        for _ in range(2):  # the second stream runs on kept segments (shm)
            stream = full_params(state, MAPPING, transport=transport, strategy="broadcast")
            for i, (name, t) in enumerate(stream):
                if i % 3 == 0:
                    kept[name] = t
            reused += stream.stats.reused_blocks
        out[transport] = (sorted(n for n, t in kept.items() if not torch.equal(t, REF[n])), reused)
    return out


def test_two_ranks_keep_targets_while_recycling() -> None:
    for rec in run_ranks(_two_ranks, 2, timeout=120):
        for transport, (wrong, reused) in rec.items():
            assert wrong == [] and reused > 0, transport


def test_a_shm_block_is_mapped_by_its_handle_and_its_descriptor_closes_with_it() -> None:
    import gc
    import os

    from shardsync.exec import shm_blocks

    t = memory.shm_block((3, 5), torch.float32)
    h = shm_blocks.handle(t)
    assert h is not None and (h.pid, h.nbytes) == (os.getpid(), 4096) and shm_blocks.handle(torch.zeros(3)) is None
    assert t.untyped_storage().nbytes() == 60  # the tensor owns exactly its bytes
    peer = shm_blocks.open_block(h)  # as a peer process maps it (keeping no descriptor)
    peer[:60].view(torch.float32).view(3, 5).copy_(arange_tensor((3, 5)))  # seen in the tensor
    assert torch.equal(t, arange_tensor((3, 5)))
    view = t[1:]
    del t
    gc.collect()
    assert os.fstat(h.fd).st_ino == h.inode  # a view keeps the block, and its descriptor, alive
    del view
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(h.fd)  # closed with the block (nothing else has opened a descriptor since)
    assert torch.equal(peer[:60].view(torch.float32).view(3, 5), arange_tensor((3, 5)))  # the peer's stays


def test_a_sealed_block_keeps_its_memory_and_no_descriptor() -> None:
    import os

    from shardsync.exec import shm_blocks

    t = memory.shm_block((4,), torch.float32)
    fd = shm_blocks.handle(t).fd  # type: ignore[union-attr]
    shm_blocks.seal(t)
    t.fill_(2.5)
    assert shm_blocks.handle(t) is None and t.tolist() == [2.5] * 4
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_pool_of_shared_memory_reuses_only_blocks_nobody_holds_and_seals_what_leaves_it() -> None:
    from shardsync.exec import shm_blocks

    pool = BlockPool(100, shm=True)
    a = pool.empty((4, 3), torch.float32)  # any size: shared even under POOL_MIN_BYTES
    handle, ptr = shm_blocks.handle(a), a.data_ptr()
    assert handle is not None and pool.holds(a)
    other = pool.empty((4, 3), torch.float32)
    assert shm_blocks.handle(other) != handle
    pool.written(a)  # complete, and still the pool's: peers may open it in a later stream
    del a
    b = pool.empty((2, 6), torch.float32)
    assert (b.data_ptr(), shm_blocks.handle(b)) == (ptr, handle) and pool.reused == 1
    big = pool.empty((30,), torch.float32)  # 120 B: over the capacity, so the oldest leave the pool
    assert not pool.holds(b) and shm_blocks.handle(b) == handle  # still being written: stays open
    pool.written(b)
    assert shm_blocks.handle(b) is None  # written and out of the pool: sealed
    assert shm_blocks.handle(other) is not None  # left the pool while being written
    pool.written(big)
    assert shm_blocks.handle(big) is None  # never in the pool (too large): sealed once written
    kept = pool.empty((2, 2), torch.float32)
    pool.discard(kept)  # a failed stream: never handed out again, open for late writers
    assert not pool.holds(kept) and shm_blocks.handle(kept) is not None


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork only")
def test_a_forked_child_holds_private_copies_of_its_parents_shared_blocks() -> None:
    import os

    from shardsync.exec import shm_blocks

    parent = memory.process_pool(1 << 20, shm=True)
    held = parent.empty((8,), torch.float32)
    held.copy_(arange_tensor((8,)))
    idle = parent.empty((8,), torch.float32)
    del idle  # idle in the parent's pool: a child must not hand it out (it is the parent's memory)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pool is its own, its copy of ``held`` private
        child = memory.process_pool(1 << 20, shm=True)
        ok = child is not parent and not child._sizes and shm_blocks.handle(held) is None
        held.add_(100)  # not seen by the parent
        os.read(r2, 1)  # the parent has written into its block: not seen here
        ok = ok and torch.equal(held, arange_tensor((8,)) + 100)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    held.mul_(-1)
    os.write(w2, b"x")
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    assert torch.equal(held, -arange_tensor((8,))) and shm_blocks.handle(held) is not None
    assert memory.process_pool(0, shm=True) is parent
