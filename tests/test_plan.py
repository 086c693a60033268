"""The planner (tier 1, no process group): reads, dedup, balance, order, buckets, validation, budget.

Plans are checked against a dense reference by simulating them: every rank builds its targets from the
reads it holds or that a step delivered before the target is yielded, sliced out of full tensors.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import arange_tensor
from shardsync.errors import LayoutError, PlanError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Piece, TargetSpec, resolve
from shardsync.planning import Plan, PlanOptions, build_plan, build_topology, choose_strategy
from shardsync.planning.model import Read

STRATEGIES = ["broadcast", "bucketed", "p2p"]


def layout_of(
    spec: dict[str, tuple[tuple[int, ...], dict[int, list[Box]]]], world: int, dtype: str = "float32"
) -> GlobalLayout:
    per_rank: list[list] = [[] for _ in range(world)]
    for key, (shape, held) in spec.items():
        for rank, boxes in held.items():
            per_rank[rank] += [(key, shape, dtype, b) for b in boxes]
    return GlobalLayout.merge(per_rank)


def rows(shape: tuple[int, ...], world: int, replicas: int = 1) -> dict[int, list[Box]]:
    """Row shards like torch.chunk over ``world // replicas`` ranks, each held by ``replicas`` ranks."""
    tp = world // replicas
    step = -(-shape[0] // tp)
    out: dict[int, list[Box]] = {}
    for r in range(world):
        t = r % tp
        lo, hi = min(t * step, shape[0]), min((t + 1) * step, shape[0])
        out[r] = [Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])] if hi > lo else []
    return out


def simulate(plan: Plan, full: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` on dense data; assert every read is present on a rank before it needs it."""
    have = [{i for i, r in enumerate(plan.reads) if rank in r.holders} for rank in range(plan.world_size)]
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(plan.world_size)}
    for step in plan.steps:
        for pk in step.packets:
            for rank in [pk.dst] if pk.dst >= 0 else range(plan.world_size):
                have[rank] |= set(pk.reads)
        for t in step.ready:
            tp = plan.targets[t]
            for rank in tp.consumers:
                x = torch.full(tp.shape, -1.0, dtype=torch.float64)
                for c in tp.copies:
                    assert c.read in have[rank], f"{tp.name}: read {c.read} missing on rank {rank}"
                    v = full[c.piece.source][c.piece.source_box.slices()].to(torch.float64)
                    x[c.piece.target_box.slices()] = v.permute(c.piece.perm) if c.piece.perm else v
                out[rank][tp.name] = x
    return out


# -- reads: dedup, balance, merge ------------------------------------------------------------------


def test_replicas_sent_once_and_balanced() -> None:
    # 4 keys in 2 row shards, each shard held by 2 replicas (DP=2 x TP=2); every rank needs all.
    lay = layout_of({f"k{i}": ((8, 4), rows((8, 4), 4, replicas=2)) for i in range(4)}, 4)
    plan = build_plan(resolve(None, lay), lay, PlanOptions(strategy="broadcast"))
    moved = [r for r in plan.reads if r.receivers]
    assert len(moved) == 8  # 4 keys x 2 shards, each once despite 2 holders
    assert all(len(r.receivers) == 2 and r.sender in r.holders for r in moved)
    senders = sorted(r.sender for r in moved)
    assert senders == [0, 0, 1, 1, 2, 2, 3, 3]  # every replica sends its share, not the lowest only
    assert plan.costs.bytes_sent == (2 * 64,) * 4


def test_replicated_on_every_rank_moves_nothing() -> None:
    lay = layout_of({"norm": ((5,), {r: [Box((0,), (5,))] for r in range(4)})}, 4)
    plan = build_plan(resolve(None, lay), lay, PlanOptions(strategy="bucketed"))
    assert [r.receivers for r in plan.reads] == [()]
    assert plan.costs.collectives == (0,) * 4 and plan.costs.bytes_received == (0,) * 4


def test_fused_shard_is_read_once_for_three_targets() -> None:
    lay = layout_of({"qkv": ((16, 3), rows((16, 3), 2))}, 2)
    targets = resolve(["qkv -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2, axis=0"], lay)
    plan = build_plan(targets, lay, PlanOptions(strategy="broadcast"))
    assert [str(r.box) for r in plan.reads] == ["[0:8, 0:3]", "[8:16, 0:3]"]
    assert plan.order == ("k", "q", "v")
    assert len(plan.steps) == 2 and plan.steps[-1].ready == (0, 1, 2)


def test_gaps_in_needed_region_read_per_fragment() -> None:
    # Only q and v of a fused shard: the K rows between them are not sent.
    lay = layout_of({"qkv": ((16, 3), rows((16, 3), 2))}, 2)
    targets = [
        t
        for t in resolve(["qkv -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2, axis=0"], lay)
        if t.name != "k"
    ]
    plan = build_plan(targets, lay, PlanOptions(strategy="broadcast"))
    assert sorted(str(r.box) for r in plan.reads) == ["[0:4, 0:3]", "[14:16, 0:3]", "[6:8, 0:3]", "[8:12, 0:3]"]


def test_read_order_follows_targets_and_fanout() -> None:
    # 'a' is built from x only; 'b' and 'c' share y: y's reads come right after a's.
    lay = layout_of({"x": ((4,), rows((4,), 2)), "y": ((4,), rows((4,), 2))}, 2)
    specs = [
        TargetSpec("a", (4,), "float32", (Piece("x", Box((0,), (4,)), Box((0,), (4,))),)),
        TargetSpec("b", (2,), "float32", (Piece("y", Box((0,), (2,)), Box((0,), (2,))),)),
        TargetSpec("c", (4,), "float32", (Piece("y", Box((0,), (4,)), Box((0,), (4,))),)),
    ]
    plan = build_plan(specs, lay, PlanOptions(strategy="broadcast"))
    assert [(r.source, str(r.box)) for r in plan.reads] == [
        ("x", "[0:2]"),
        ("x", "[2:4]"),
        ("y", "[0:2]"),
        ("y", "[2:4]"),
    ]
    assert plan.order == ("a", "b", "c")


# -- strategies: steps, counts, delivery -------------------------------------------------------------


def test_bucketed_collective_count_is_exact() -> None:
    # 6 keys of [8, 4] float32 in 2 row shards: 6 reads of 64 B per sender; 128 B buckets hold two.
    lay = layout_of({f"k{i}": ((8, 4), rows((8, 4), 2)) for i in range(6)}, 2)
    bucketed = build_plan(resolve(None, lay), lay, PlanOptions(strategy="bucketed", bucket_bytes=128))
    assert bucketed.costs.collectives == (6, 6)
    assert [len(s.packets) for s in bucketed.steps] == [2, 2, 2]
    assert all(pk.offsets == (0, 64) and pk.nbytes == 128 for s in bucketed.steps for pk in s.packets)
    one_each = build_plan(resolve(None, lay), lay, PlanOptions(strategy="broadcast"))
    assert one_each.costs.collectives == (12, 12)
    big = build_plan(resolve(None, lay), lay, PlanOptions(strategy="bucketed"))
    assert big.costs.collectives == (2, 2) and big.costs.bytes_received == (6 * 64, 6 * 64)


def test_consumers_split_targets_and_receive_by_p2p() -> None:
    lay = layout_of({f"k{i}": ((6, 2), rows((6, 2), 4)) for i in range(5)}, 4)
    plan = build_plan(resolve(None, lay), lay, PlanOptions(consumers=(3, 1)))
    assert plan.strategy == "p2p"
    assert [t.consumers for t in plan.targets] == [(3,)] * 3 + [(1,)] * 2
    assert plan.targets_of(3) == ("k0", "k1", "k2") and plan.targets_of(0) == ()
    assert plan.costs.bytes_received[0] == plan.costs.bytes_received[2] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_simulated_plan_matches_dense_reference(strategy: str) -> None:
    shapes = {"a": (17, 3), "b": (5, 17), "c": (127,), "r": (4, 4)}
    spec = {
        "a": ((17, 3), rows((17, 3), 2)),
        "c": ((127,), rows((127,), 2)),
        "b": ((5, 17), {0: [Box((0, 0), (5, 9))], 1: [Box((0, 9), (5, 8))]}),
        "r": ((4, 4), {0: [Box((0, 0), (4, 4))], 1: [Box((0, 0), (4, 4))]}),
    }
    lay = layout_of(spec, 2)
    full = {k: arange_tensor(s) for k, s in shapes.items()}
    targets = resolve(["b^T -> bt", "a -> a1, a2, axis=1, sizes='[2, 1]'", "c, c -> cc, axis=0"], lay)
    plan = build_plan(targets, lay, PlanOptions(strategy=strategy, bucket_bytes=200))
    got = simulate(plan, full)
    ref = {
        "a1": full["a"][:, :2],
        "a2": full["a"][:, 2:],
        "bt": full["b"].T,
        "cc": torch.cat([full["c"], full["c"]]),
        "r": full["r"],
    }
    for rank in range(2):
        assert sorted(got[rank]) == sorted(ref)
        for name, x in ref.items():
            assert torch.equal(got[rank][name], x.to(torch.float64)), (rank, name)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    m=st.integers(1, 6),
    world=st.sampled_from([2, 3, 4]),
    replicas=st.sampled_from([1, 2]),
    strategy=st.sampled_from(STRATEGIES),
    cap=st.sampled_from([64, 256, 1 << 20]),
    budget=st.booleans(),
)
def test_random_layouts_simulate_exactly(
    n: int, m: int, world: int, replicas: int, strategy: str, cap: int, budget: bool
) -> None:
    if world % replicas:
        replicas = 1
    lay = layout_of(
        {
            "x": ((n, m), rows((n, m), world, replicas)),
            "y": ((m, n), {r: [Box((0, 0), (m, n))] for r in range(0, world, 2)}),
        },
        world,
    )
    full = {"x": arange_tensor((n, m)), "y": arange_tensor((m, n), start=1000)}
    targets = resolve(["x^T -> xt", "xt, y -> z, axis=0"], lay)
    limit = 2 * n * m * 8 + 8 * 1024 if budget else None
    plan = build_plan(targets, lay, PlanOptions(strategy=strategy, bucket_bytes=cap, memory_budget=limit))
    got = simulate(plan, full)
    z = torch.cat([full["x"].T, full["y"]]).to(torch.float64)
    assert all(torch.equal(got[r]["z"], z) for r in range(world))
    if budget:
        assert max(plan.costs.peak_bytes) <= limit


# -- memory budget -------------------------------------------------------------------------------------


def test_memory_budget_shrinks_buckets_and_cuts_reads() -> None:
    lay = layout_of({f"k{i}": ((64, 16), rows((64, 16), 2)) for i in range(4)}, 2)  # 4 KiB targets
    free = build_plan(resolve(None, lay), lay, PlanOptions(strategy="bucketed"))
    assert max(free.costs.peak_bytes) == 4096 * 4 + 4096 * 4  # all open + both 8 KiB buckets
    for strategy, budget in (("bucketed", 11000), ("broadcast", 6000), ("p2p", 6000)):
        tight = build_plan(resolve(None, lay), lay, PlanOptions(strategy=strategy, memory_budget=budget))
        assert max(tight.costs.peak_bytes) <= budget and tight.bucket_bytes < free.bucket_bytes
        assert max(r.nbytes for r in tight.reads) <= tight.bucket_bytes
        assert strategy == "bucketed" or len(tight.reads) > len(free.reads)  # 2 KiB reads were cut
    with pytest.raises(
        PlanError,
        match=r"target 'k0' \(4096 B\) is held whole while it is built; "
        r"raise memory_budget above 4096 B",
    ):
        build_plan(resolve(None, lay), lay, PlanOptions(strategy="broadcast", memory_budget=3000))
    with pytest.raises(PlanError, match=r"even with 256 B buckets .* raise memory_budget to \d+ B or more"):
        build_plan(resolve(None, lay), lay, PlanOptions(strategy="broadcast", memory_budget=4100))


# -- validation: every offender, before anything moves ---------------------------------------------


def test_holes_and_overlaps_are_all_reported() -> None:
    lay = layout_of(
        {
            "hole": ((10, 2), {0: [Box((0, 0), (4, 2))], 1: [Box((6, 0), (4, 2))]}),
            "ovl": ((10,), {0: [Box((0,), (6,))], 1: [Box((4,), (6,))]}),
            "twice": ((3,), {0: [Box((0,), (3,)), Box((0,), (3,))], 1: []}),
        },
        2,
    )
    with pytest.raises(LayoutError) as err:
        build_plan(resolve(None, lay), lay, PlanOptions())
    text = str(err.value)
    assert "3 problems" in text
    assert "'hole': box [4:6, 0:2] (needed by target 'hole') is held by no rank" in text
    assert "'ovl': shard [0:6] on ranks [0] overlaps shard [4:10] on ranks [1] in [4:6]" in text
    assert "'twice': rank 0 holds box [0:3] 2 times" in text


def test_shape_disagreement_names_ranks() -> None:
    with pytest.raises(LayoutError, match=r"'w': ranks disagree.*ranks \[0\] say shape \[4\] float32"):
        GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (4,)))], [("w", (5,), "float32", Box((0,), (5,)))]])


def test_malformed_targets_are_all_reported() -> None:
    lay = layout_of({"x": ((4,), {0: [Box((0,), (4,))]})}, 1)
    bad = [
        TargetSpec("gap", (4,), "float32", (Piece("x", Box((0,), (2,)), Box((0,), (2,))),)),
        TargetSpec("cast", (4,), "bfloat16", (Piece("x", Box((0,), (4,)), Box((0,), (4,))),)),
        TargetSpec("ghost", (1,), "float32", (Piece("nope", Box((0,), (1,)), Box((0,), (1,))),)),
    ]
    with pytest.raises(PlanError) as err:
        build_plan(bad, lay, PlanOptions())
    text = str(err.value)
    assert "target 'gap': box [2:4] is not covered" in text
    assert "yields float32 but the target is bfloat16; add a cast" in text
    assert "unknown source 'nope'" in text


def test_bad_options_are_all_reported() -> None:
    lay = layout_of({"x": ((4,), rows((4,), 2))}, 2)
    opts = PlanOptions(strategy="bucketed", num_splits=2, split_index=5, consumers=(0, 0, 7), bucket_bytes=0)
    with pytest.raises(PlanError) as err:
        build_plan(resolve(None, lay), lay, opts)
    text = str(err.value)
    for part in (
        "split_index=5",
        "bucket_bytes=0",
        "consumers [0, 0, 7]",
        "with consumers use one of ['auto', 'p2p', 'multicast']",
    ):
        assert part in text


# -- splits, order, determinism -----------------------------------------------------------------------


def test_num_splits_selects_contiguous_parts() -> None:
    lay = layout_of({f"k{i}": ((2 if i else 40,), {0: [Box((0,), (2 if i else 40,))]}) for i in range(5)}, 1)
    names = lambda **kw: build_plan(resolve(None, lay), lay, PlanOptions(**kw)).order  # noqa: E731
    assert [names(num_splits=2, split_index=i) for i in (0, 1)] == [("k0", "k1", "k2"), ("k3", "k4")]
    assert [names(num_splits=2, split_index=i, split_by="bytes") for i in (0, 1)] == [("k0",), ("k1", "k2", "k3", "k4")]
    assert names(num_splits=7, split_index=6) == ()


def test_plan_is_deterministic_and_frozen() -> None:
    lay = layout_of({f"k{i}": ((9, 3), rows((9, 3), 4, replicas=2)) for i in range(3)}, 4)
    a = build_plan(resolve(None, lay), lay, PlanOptions(strategy="bucketed", bucket_bytes=100))
    b = build_plan(
        resolve(None, GlobalLayout.from_json(lay.to_json())), lay, PlanOptions(strategy="bucketed", bucket_bytes=100)
    )
    assert a == b and a.fingerprint() == b.fingerprint()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.strategy = "p2p"  # type: ignore[misc]


def test_auto_strategy_choice() -> None:
    o = PlanOptions()
    assert choose_strategy(o, None) == "bucketed"
    assert choose_strategy(dataclasses.replace(o, consumers=(0,)), None) == "p2p"
    assert choose_strategy(dataclasses.replace(o, backend="nccl"), ((0, 1),)) == "mesh2d"
    assert choose_strategy(o, ((0, 1),)) == "bucketed"  # gloo: all_gather is slow
    assert choose_strategy(dataclasses.replace(o, strategy="broadcast"), None) == "broadcast"


def test_auto_sends_big_reads_alone_and_buckets_small_ones() -> None:
    big = (1 << 20) // 4 // 2  # rows of 4 float32 making a 1 MiB shard per rank
    lay = layout_of(
        {"big": ((2 * big, 4), rows((2 * big, 4), 2)), "n1": ((4,), rows((4,), 2)), "n2": ((4,), rows((4,), 2))}, 2
    )
    auto = build_plan(resolve(None, lay), lay, PlanOptions())
    assert auto.strategy == "bucketed"
    assert [[len(pk.reads) for pk in s.packets] for s in auto.steps] == [[1], [1], [2, 2]]
    explicit = build_plan(resolve(None, lay), lay, PlanOptions(strategy="bucketed"))
    assert [[len(pk.reads) for pk in s.packets] for s in explicit.steps] == [[3, 3]]


def test_read_nbytes() -> None:
    r = Read("x", Box((0, 0), (3, 5)), "bfloat16", (0,), (0, 1), (1,), 0)
    assert r.nbytes == 30


# -- mesh2d --------------------------------------------------------------------------------------------


def test_topology_from_groups() -> None:
    h, v = [(0, 1), (0, 1), (2, 3), (2, 3)], [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert build_topology(h, v) == ((0, 1), (2, 3))
    with pytest.raises(PlanError, match="not a 2-D grid") as err:
        build_topology([(0, 1), (0, 1), (2, 3), (2, 3)], [(0, 2), (1, 3), (2, 0), (1, 3)])
    assert "ranks 0 and 2 both sit at row 0, column 0" in str(err.value)


def test_mesh_batches_one_read_per_column_with_padding_and_threshold() -> None:
    topo = ((0, 1), (2, 3))
    lay = layout_of(
        {
            "a": ((8, 4), rows((8, 4), 4)),
            "odd": ((3,), {1: [Box((0,), (3,))]}),
            "zbig": ((64,), {2: [Box((0,), (64,))]}),
        },
        4,
    )
    plan = build_plan(resolve(None, lay), lay, PlanOptions(strategy="mesh2d", mesh_threshold_bytes=500), topology=topo)
    kinds = [(s.kind, [(pk.src, [str(plan.reads[i].box) for i in pk.reads]) for pk in s.packets]) for s in plan.steps]
    assert kinds == [
        ("mesh_hv", [(0, ["[0:2, 0:4]"]), (1, ["[2:4, 0:4]"])]),
        ("mesh_hv", [(2, ["[4:6, 0:4]"]), (3, ["[6:8, 0:4]"])]),
        ("mesh_hv", [(-1, []), (1, ["[0:3]"])]),  # column 0 pads
        ("mesh_global", [(2, ["[0:64]"])]),
    ]  # 256 B x 2 columns > 500
    # hv step: an all_gather, plus a vertical broadcast where the rank's column is real (not padding);
    # global step: a vertical broadcast in the sender's column (ranks 0, 2), a horizontal one everywhere
    assert plan.costs.collectives == (2 + 2 + 1 + 2, 2 + 2 + 2 + 1, 2 + 2 + 1 + 2, 2 + 2 + 2 + 1)
    # rank 1 (row 0, column 1): gathers 32, then 32 down its column + 32 gathered, then gathers the
    # 12 B padded batch, then the 256 B read across row 0
    assert plan.costs.bytes_received[1] == 32 + (32 + 32) + 12 + 256
    full = {"a": arange_tensor((8, 4)), "odd": arange_tensor((3,)), "zbig": arange_tensor((64,))}
    got = simulate(plan, full)
    assert all(torch.equal(got[r][k], full[k].to(torch.float64)) for r in range(4) for k in full)


def test_mesh_needs_topology_and_every_consumer() -> None:
    lay = layout_of({"a": ((4,), rows((4,), 2))}, 2)
    with pytest.raises(PlanError, match="needs mesh="):
        build_plan(resolve(None, lay), lay, PlanOptions(strategy="mesh2d"))
    with pytest.raises(PlanError, match="delivers to every rank"):
        build_plan(resolve(None, lay), lay, PlanOptions(strategy="mesh2d", consumers=(0,)), topology=((0, 1),))


def test_strategy_names_checks_and_messages_come_from_one_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardsync.planning.strategies as table
    from shardsync.exec import TRANSPORTS
    from shardsync.planning import STEP_COSTS, StepKind, check_options
    from shardsync.planning.strategies import strategy_problems

    assert set(TRANSPORTS) == set(table.STRATEGIES) and set(STEP_COSTS) == set(typing.get_args(StepKind))
    ring = dataclasses.replace(table.STRATEGIES["p2p"], name="ring", every_rank=True, needs_mesh=True)
    monkeypatch.setitem(table.STRATEGIES, "ring", ring)
    check_options(PlanOptions(strategy="ring"), world=2, meshed=True)  # a known name now
    assert strategy_problems("ring", consumers=True, mesh=False) == [
        "strategy 'ring' delivers to every rank; with consumers use one of ['auto', 'p2p', 'multicast']",
        "strategy 'ring' needs mesh=(horizontal group, vertical group) or a 2-D DeviceMesh",
    ]
    assert strategy_problems("tree", consumers=False, mesh=False) == [
        "strategy 'tree' is unknown; use one of ['auto', 'broadcast', 'bucketed', 'mesh2d', 'p2p', 'multicast', 'ring']"
    ]
