"""Local assembly and accounting (tier 1): casts, permutations, reading shards in place, stats."""

from __future__ import annotations

import pytest
import torch

import shardsync.exec.assemble as assemble
from reference import arange_tensor
from shardsync.errors import LayoutError
from shardsync.exec import Stats, cast_into, copy_piece
from shardsync.layout import Box, LocalShard
from shardsync.mapping import Piece
from shardsync.sources import LocalSource

CHAINS = [
    ("bfloat16", "float32"),
    ("float16", "bfloat16"),
    ("float16", "float64", "bfloat16"),
    ("bfloat16",),
    ("float64",),
]


@pytest.mark.parametrize("casts", CHAINS)
def test_cast_chain_is_bit_exact_with_casts_in_order(casts: tuple[str, ...]) -> None:
    x = arange_tensor((37, 11), step=0.3791, start=-70)
    want = x
    for c in casts:
        want = want.to(getattr(torch, c))
    out = torch.empty(x.shape, dtype=want.dtype)
    cast_into(out, x, casts)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_cast_chain_works_in_bounded_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = assemble._chain
    monkeypatch.setattr(assemble, "CHAIN_CHUNK_ELEMENTS", 50)
    monkeypatch.setattr(assemble, "_chain", lambda x, casts: seen.append(x.numel()) or real(x, casts))
    x = arange_tensor((17, 11), step=0.37)
    out = torch.empty(17, 11)
    cast_into(out, x, ("bfloat16", "float32"))
    assert seen == [44, 44, 44, 44, 11]  # 4 rows of 11 per chunk, never the whole tensor
    assert torch.equal(out, x.to(torch.bfloat16).to(torch.float32))


def test_copy_piece_permutes_and_casts_in_one_copy() -> None:
    src = arange_tensor((4, 6, 5), step=0.51)
    out = torch.full((5, 3, 6), -1.0, dtype=torch.bfloat16)
    origin = Box((2, 0, 0), (4, 6, 5))  # the tensor holds rows 2..5 of a bigger source
    piece = Piece("s", Box((3, 0, 0), (3, 6, 5)), Box((0, 0, 0), (5, 3, 6)), perm=(2, 0, 1), casts=("bfloat16",))
    copy_piece(out, src, origin, piece)
    assert torch.equal(out, src[1:4].permute(2, 0, 1).to(torch.bfloat16))


def test_local_source_reads_the_right_shard_in_place() -> None:
    full = arange_tensor((17, 3))
    shards = [LocalShard(full[:9], (17, 3), (0, 0)), LocalShard(full[9:], (17, 3), (9, 0))]
    src = LocalSource({"w": shards, "b": full})
    view = src.read("w", Box((10, 1), (3, 2)))
    assert torch.equal(view, full[10:13, 1:3]) and view.data_ptr() == full[10:, 1:].data_ptr()
    assert src.read("b", Box.full((17, 3))) is full  # the whole tensor is the tensor itself
    with pytest.raises(LayoutError, match=r"'w': this rank holds no shard containing \[8:10, 0:3\]"):
        src.read("w", Box((8, 0), (2, 3)))


def test_stats_hold_release_and_peak() -> None:
    s = Stats()
    s.hold(100, tag=1)
    s.hold(50, tag=-1)
    s.hold(25, tag=-1)
    s.release(tag=-1)
    s.hold(10)
    s.release(tag=1)
    s.release(10)
    assert (s.held_bytes, s.peak_bytes) == (0, 175)


def test_a_stream_of_parameters_turns_autograd_off_only_while_it_works() -> None:
    """The executor turns autograd off once per target (not once per piece), looking at the caller's
    setting for every target: the targets it makes from parameters that require grad - copies, and
    views of a parameter (zero copy) - carry no autograd history and hold the exact values, and the
    caller's own code between targets runs with its own setting, which it may change as it goes."""
    from shardsync.stream import full_params

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(arange_tensor((2 * 151, 257), start=-3.0))  # 310 KB
    model.b = torch.nn.Parameter(arange_tensor((263,), start=0.5))
    state = {k: p for k, p in model.named_parameters()}  # the parameters themselves, requiring grad
    mapping = ["w^T -> wt", "w -> w3, dtype='float64'", "w -> wa, wb, axis=0", "b -> b"]
    w = model.w.detach()
    want = {"wt": w.T, "w3": w.double(), "wa": w[:151], "wb": w[151:], "b": model.b.detach()}
    views = {"wa", "wb", "b"}  # row halves of a parameter, and a whole one: zero copy (copy=False)
    for grad in (True, False):  # the caller starts with grad on, or off, and flips it every target
        seen = []
        torch.set_grad_enabled(grad)
        try:
            for name, t in full_params(state, mapping, copy=False):
                seen.append(torch.is_grad_enabled())
                torch.set_grad_enabled(not torch.is_grad_enabled())
                assert torch.equal(t, want[name]) and t.dtype == want[name].dtype, name
                source = model.b if name == "b" else model.w
                assert (t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()) == (name in views), name
                if name == "b":  # the parameter itself, as it is
                    assert t is model.b
                elif name in views:  # a view of a leaf made under no_grad: torch keeps requires_grad
                    assert t.grad_fn is None, name
                else:
                    assert not t.requires_grad and t.grad_fn is None, name
        finally:
            torch.set_grad_enabled(True)
        assert seen == [grad, not grad] * 2 + [grad], seen
    assert torch.is_grad_enabled()
