"""full_params in a single process (no process group): order, splits, copies, views, casts, errors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from reference import arange_tensor
from shardsync.errors import LayoutError, MappingError, PlanError
from shardsync.layout import LocalShard, shard_dim
from shardsync.paddle import full_param
from shardsync.stream import full_params, plan

QKV = "qkv -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2, axis=0"
FFN = "gu -> gate, up, fused_ffn, axis=0"


def shards(full: torch.Tensor, dim: int, n: int) -> list[LocalShard]:
    """All ``n`` shards of ``full`` along ``dim``, held by this one process."""
    return [shard_dim(full, dim, r, n) for r in range(n)]


def model() -> dict[str, torch.Tensor]:
    return {
        "emb": arange_tensor((17, 6), step=0.37),
        "norm": arange_tensor((6,), start=3),
        "proj": arange_tensor((6, 8), start=-9, step=0.71),
        "ids": torch.arange(5),
        "qkv": arange_tensor((24, 5), start=100),
        "gu": arange_tensor((16, 5), start=500),
    }


def test_identity_yields_sorted_clones_one_at_a_time() -> None:
    full = model()
    stream = full_params(full)
    it = iter(stream)
    first = next(it)
    assert first[0] == "emb" and stream.stats.targets == 1  # built lazily, one target at a time
    got = dict([first, *it])
    assert list(got) == sorted(full)
    for k, x in full.items():
        assert torch.equal(got[k], x) and got[k].data_ptr() != x.data_ptr()
    assert stream.stats.peak_bytes == max(x.nbytes for x in full.values())
    assert (stream.stats.bytes_sent, stream.stats.collectives) == (0, 0)


def test_large_targets_are_built_one_ahead_while_the_caller_has_the_last() -> None:
    # 4 MiB or more (AHEAD_BYTES): the next target's copies run while the caller holds this one
    full = {f"w{i}": arange_tensor((1031, 1021 + i), start=i, step=0.5) for i in range(3)}
    mapping = ["w0 -> w0", "w1^T -> w1t", "w2 -> w2"]
    stream = full_params(full, mapping)
    got, held = {}, []
    for name, t in stream:
        got[name] = t
        held.append(stream.stats.held_bytes)  # the next one, under way
    assert held == [full["w1"].nbytes, full["w2"].nbytes, 0]
    assert torch.equal(got["w0"], full["w0"]) and torch.equal(got["w2"], full["w2"])
    assert torch.equal(got["w1t"], full["w1"].t())
    two = full["w1"].nbytes + full["w2"].nbytes
    assert stream.stats.peak_bytes == two == stream.plan.costs.peak_bytes[0]
    # a budget of one target: built when asked for, one at a time
    one = full_params(full, mapping, memory_budget=full["w2"].nbytes)
    assert all(torch.equal(t, got[n]) for n, t in one)
    assert one.stats.peak_bytes == full["w2"].nbytes and one.plan.depth == 1


def test_leaving_early_waits_for_the_copies_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from shardsync.exec import copies

    ends: list[float] = []
    jobs = copies._jobs

    def slow(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[Any, Any, Any]]:
        def chunk(fn: Any, d: Any, s: Any) -> None:
            time.sleep(0.02)
            fn(d, s)
            ends.append(time.monotonic())

        return [(functools.partial(chunk, fn), d, s) for fn, d, s in jobs(dst, src)]

    monkeypatch.setattr(copies, "_jobs", slow)
    full = {f"w{i}": arange_tensor((1100, 1000), start=i) for i in range(3)}
    stream = full_params(full, [f"w{i}^T -> t{i}" for i in range(3)])
    for name, t in stream:
        assert name == "t0" and torch.equal(t, full["w0"].t())
        break
    stream.close()
    closed = time.monotonic()
    assert ends and max(ends) <= closed  # t1's copies, started ahead, all ended before close returned


def test_copy_false_returns_the_source_or_a_view() -> None:
    full = model()
    got = dict(full_params(full, ["emb -> e1, e2, axis=0, sizes='[5, 12]'", "proj^T -> proj_t"], copy=False))
    assert got["norm"] is full["norm"]
    assert got["e2"]._base is full["emb"] and torch.equal(got["e2"], full["emb"][5:])
    assert got["proj_t"].is_contiguous() and torch.equal(got["proj_t"], full["proj"].T)  # one copy


def test_sharded_sources_mapped_like_the_dense_reference() -> None:
    full = model()
    state = {
        "qkv": shards(full["qkv"], 0, 2),
        "gu": shards(full["gu"], 0, 2),
        "emb": shards(full["emb"], 0, 2),
        "proj": shards(full["proj"], 1, 2),
        "norm": full["norm"],
    }
    mapping = [
        QKV,
        FFN,
        "proj^T -> proj_t",
        "norm -> norm, dtype='bfloat16'",
        "emb -> emb, dtype='bfloat16'",
        "emb -> emb, dtype='float32'",
    ]
    got = dict(full_params(state, mapping))
    w, g = full["qkv"], full["gu"]
    ref = {
        "q": torch.cat([w[0:6], w[12:18]]),
        "k": torch.cat([w[6:9], w[18:21]]),
        "v": torch.cat([w[9:12], w[21:24]]),
        "gate": torch.cat([g[0:4], g[8:12]]),
        "up": torch.cat([g[4:8], g[12:16]]),
        "proj_t": full["proj"].T,
        "norm": full["norm"].to(torch.bfloat16),
        "emb": full["emb"].to(torch.bfloat16).to(torch.float32),
    }
    assert list(got) == sorted(ref)
    for k, x in ref.items():
        assert got[k].dtype == x.dtype and torch.equal(got[k], x), k


def test_num_splits_are_contiguous_parts_of_sorted_names() -> None:
    full = {f"t{i:02d}": torch.full((i + 1,), float(i)) for i in range(11)}
    parts = [list(dict(full_params(full, num_splits=4, split_index=i))) for i in range(4)]
    names = sorted(full)
    assert parts == [names[0:3], names[3:6], names[6:9], names[9:11]]
    by_bytes = [list(dict(full_params(full, num_splits=2, split_index=i, split_by="bytes"))) for i in (0, 1)]
    assert by_bytes == [names[:8], names[8:]]  # 1+..+8 = 36 of 66 elements: closest cut to half


def test_missing_box_names_key_and_box() -> None:
    full = model()
    with pytest.raises(LayoutError) as err:
        list(full_params({"emb": [shard_dim(full["emb"], 0, 0, 2)], "proj": [shard_dim(full["proj"], 1, 1, 2)]}))
    text = str(err.value)
    assert "'emb': box [9:17, 0:6] (needed by target 'emb') is held by no rank" in text
    assert "'proj': box [0:6, 0:4] (needed by target 'proj') is held by no rank" in text


def test_memory_budget_is_respected_locally() -> None:
    full = {f"w{i}": arange_tensor((64, 32), start=i) for i in range(5)}  # 8 KiB each
    stream = full_params(full, memory_budget=9000)
    assert all(torch.equal(t, full[n]) for n, t in stream)
    assert stream.stats.peak_bytes == 8192 <= stream.plan.costs.peak_bytes[0] <= 9000
    with pytest.raises(PlanError, match="raise memory_budget above 8192 B"):
        list(full_params(full, memory_budget=4000))


def test_errors_and_once_only() -> None:
    full = model()
    with pytest.raises(MappingError):
        list(full_params(full, ["nope -> x"]))
    with pytest.raises(PlanError, match="split_index 3 outside|split_index=3"):
        list(full_params(full, num_splits=2, split_index=3))
    stream = full_params(full)
    list(stream)
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(stream)


def test_outputs_do_not_track_gradients() -> None:
    p = torch.nn.Parameter(arange_tensor((3, 4)))
    halves = [LocalShard(p[:2], (3, 4), (0, 0)), LocalShard(p[2:], (3, 4), (2, 0))]
    ((name, t),) = full_params({"p": halves})
    assert not t.requires_grad and t.grad_fn is None and torch.equal(t, p.detach())


def test_plan_inspection_and_paddle_entry() -> None:
    full = model()
    p = plan(full, [QKV, FFN])
    assert p.order == ("emb", "gate", "ids", "k", "norm", "proj", "q", "up", "v")
    assert p.costs.bytes_received == (0,) and p.strategy == "bucketed"
    got = dict(full_param(full, {"aoa_statements": [QKV, FFN]}, num_splits=3, shard_idx=1))
    assert list(got) == ["k", "norm", "proj"]
    assert torch.equal(got["k"], full["qkv"][12:18])  # one shard: [Q | K | V] of 12 / 6 / 6 rows
    with pytest.raises(TypeError, match="unexpected keyword"):
        full_param(full, num_split=2)
    with pytest.raises(ValueError, match="both h_group and v_group"):
        full_param(full, h_group=object())


def test_plans_are_cached_per_layout_mapping_and_options() -> None:
    from shardsync.pipeline import _planned

    state = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3)}
    _planned.cache_clear()
    first = full_params(state, ["w -> a, c, axis=0"])
    list(first)
    again = full_params(state, ["w -> a, c, axis=0"])
    list(again)
    assert again.plan is first.plan and _planned.cache_info().hits == 1
    other = full_params(state, ["w -> a, c, axis=0"], num_splits=2)  # other options: a new plan
    list(other)
    bigger = full_params({**state, "w": torch.zeros(6, 3)}, ["w -> a, c, axis=0"])  # other layout
    assert [t.shape for _, t in bigger] == [(3, 3), (3,), (3, 3)]
    assert other.plan is not first.plan and _planned.cache_info().misses == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"strategy": "bogus"},
            "strategy 'bogus' is unknown; use one of ['auto', 'broadcast', 'bucketed', 'mesh2d', 'p2p', 'multicast']",
        ),
        ({"strategy": "mesh2d"}, "strategy 'mesh2d' needs mesh=(horizontal group, vertical group)"),
        ({"num_splits": 2, "split_index": 2}, "num_splits=2, split_index=2: use integers with num_splits >= 1"),
        ({"split_index": -1}, "num_splits=1, split_index=-1: use integers"),
        ({"num_splits": 0}, "num_splits=0, split_index=0: use integers"),
        ({"split_by": "size"}, "split_by 'size' is unknown; use 'count' or 'bytes'"),
        ({"consumers": "rank0"}, "consumers='rank0': use 'all', a rank, or a list of ranks"),
        ({"consumers": 1.5}, "consumers=1.5: use 'all', a rank, or a list of ranks"),
        ({"consumers": [1]}, "consumers [1]: use distinct ranks in [0, 1)"),
        ({"consumers": [0, 0]}, "consumers [0, 0]: use distinct ranks in [0, 1)"),
        (
            {"consumers": 0, "strategy": "bucketed"},
            "strategy 'bucketed' delivers to every rank; with consumers use one of ['auto', 'p2p', 'multicast']",
        ),
        ({"bucket_bytes": 0}, "bucket_bytes=0: use a positive number of bytes"),
        ({"bucket_bytes": 1.5}, "bucket_bytes=1.5: use a positive number of bytes"),
        ({"memory_budget": -1}, "memory_budget=-1: use a positive number of bytes"),
        ({"mesh_threshold_bytes": 0}, "mesh_threshold_bytes=0: use a positive number of bytes"),
        ({"mesh": "2x2"}, "mesh must be a 2-D DeviceMesh or (horizontal group, vertical group); got str"),
    ],
)
def test_argument_errors_are_raised_by_the_call(kwargs: dict, message: str) -> None:
    with pytest.raises(PlanError) as err:
        full_params(model(), **kwargs)  # not iterated: the call itself raises
    assert message in str(err.value)
    with pytest.raises(PlanError):
        plan(model(), **kwargs)


def test_every_argument_error_is_reported_at_once() -> None:
    with pytest.raises(PlanError) as err:
        full_params(model(), strategy="bogus", split_by="size", bucket_bytes=0)
    assert str(err.value) == (
        "invalid stream options:\n"
        "  strategy 'bogus' is unknown; use one of ['auto', 'broadcast', 'bucketed', 'mesh2d', 'p2p', 'multicast']\n"
        "  split_by 'size' is unknown; use 'count' or 'bytes'\n"
        "  bucket_bytes=0: use a positive number of bytes"
    )


def test_a_module_is_streamed_like_its_state() -> None:
    net = torch.nn.Linear(3, 2)
    with pytest.raises(
        LayoutError,
        match=r"state must be a mapping of names to tensors, a Source, a module or a "
        r"checkpoint path, got list",
    ):
        full_params([torch.zeros(2)])
    got = dict(full_params(net))
    assert list(got) == ["bias", "weight"] and torch.equal(got["weight"], net.weight.detach())
    tied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight  # a tied key is streamed once, through the first
    assert [n for n, _ in full_params(tied)] == ["0.weight"]


def test_meta_tensors_are_refused_by_key() -> None:
    state = {"w": arange_tensor((4, 3)), "lazy": torch.empty(5, 3, device="meta")}
    with pytest.raises(
        LayoutError,
        match=r"^'lazy' is a meta tensor \(a shape without data\), so there "
        r"is nothing to stream; materialise it first",
    ):
        list(full_params(state))
    halves = [
        LocalShard(torch.empty(2, 3, device="meta"), (4, 3), (0, 0)),
        LocalShard(arange_tensor((2, 3)), (4, 3), (2, 0)),
    ]
    with pytest.raises(LayoutError, match=r"^'half' is a meta tensor"):
        list(full_params({"half": halves}))


def test_keys_that_are_not_strings_are_named() -> None:
    with pytest.raises(
        LayoutError,
        match=r"^state key 3 \(int\) is not a string; state dict keys must "
        r"be strings",
    ):
        list(full_params({"w": torch.zeros(2), 3: torch.ones(2)}))
    with pytest.raises(LayoutError, match=r"^state key \('a', 1\) \(tuple\) is not a string"):
        plan({("a", 1): torch.ones(2)})
