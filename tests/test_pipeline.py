"""The one orchestrator: every verb runs through it on 1, 2 and 4 ranks, with the same guarantees (the
fast path, replicas checked on every call); the phase table; the options type; deprecated names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync import phases, pipeline
from shardsync.errors import FormatError, LayoutError, PlanError
from shardsync.io.file_plan import file_owners, plan_files
from shardsync.layout import shard_dim
from shardsync.mapping import TargetSpec
from shardsync.options import Options
from shardsync.planning import PlanOptions, TargetPlan
from shardsync.quant.fp8 import Fp8Quantize

SRC = Path(__file__).resolve().parents[1] / "src" / "shardsync"
MAPPING = ["w^T -> w_t", "b -> b", "norm -> norm"]
FULL_W = arange_tensor((17, 3), step=0.5)
FULL_B = arange_tensor((7,), start=-3)
NORM = arange_tensor((5,), start=10)


def _expected() -> dict[str, torch.Tensor]:
    return {"b": FULL_B, "norm": NORM, "w_t": FULL_W.T}


def _state(rank: int, world: int) -> dict[str, object]:
    # w and b sharded unevenly by rows; norm a replica on every rank
    return {"w": shard_dim(FULL_W, 0, rank, world), "b": shard_dim(FULL_B, 0, rank, world), "norm": NORM.clone()}


def _local(shard: object) -> torch.Tensor:
    return shard.local if hasattr(shard, "local") else shard  # type: ignore[union-attr]


def _every_verb(rank: int, world: int, out: str) -> dict[str, object]:
    """Each verb once (twice where the fast path matters), on every rank of ``world``."""
    prepared: list[str] = []
    real = pipeline.choose_transport  # every call of every verb passes here exactly once

    def counting(*args: object, **kwargs: object) -> object:
        prepared.append("call")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    pipeline.choose_transport = counting  # type: ignore[assignment]
    try:
        return _verbs(rank, world, Path(out), prepared)
    finally:
        pipeline.choose_transport = real


def _verbs(rank: int, world: int, out: Path, prepared: list[str]) -> dict[str, object]:
    state, res = _state(rank, world), {}
    first = shardsync.full_params(state, MAPPING)
    got = dict(first)
    res["full_params"] = sorted(got) == sorted(_expected()) and all(
        torch.equal(got[k], v) for k, v in _expected().items()
    )
    again = shardsync.full_params(state, MAPPING)
    res["fast path"] = dict(again).keys() == got.keys() and again.plan is first.plan
    if world > 1:  # a replica that drifts after the plan was cached is caught on the fast path
        state["norm"] = NORM + (rank == 1)
        try:
            list(shardsync.full_params(state, MAPPING))
            res["drift"] = "no error"
        except LayoutError as exc:
            res["drift"] = str(exc).splitlines()[0]
        state["norm"] = NORM.clone()
    res["plan"] = shardsync.plan(state, MAPPING).order
    dst = {"w_t": shard_dim(torch.zeros(3, 17), 1, rank, world), "b": torch.zeros(7), "norm": torch.zeros(5)}
    loaded = shardsync.load(dst, state, MAPPING, reverse=False)
    res["load"] = (
        loaded.missing == ()
        and torch.equal(_local(dst["w_t"]), _local(shard_dim(FULL_W.T, 1, rank, world)))
        and torch.equal(dst["b"], FULL_B)
    )
    into = {"w": shard_dim(torch.zeros(17, 3), 1, rank, world), "b": torch.zeros(7), "norm": torch.zeros(5)}
    first_r = shardsync.reshard(state, into)
    second_r = shardsync.reshard(state, into)
    res["reshard"] = (
        torch.equal(_local(into["w"]), _local(shard_dim(FULL_W, 1, rank, world))) and second_r.plan is first_r.plan
    )
    shardsync.save_hf(state, out / "hf", MAPPING, max_file_size=100, dtype="bf16", overwrite=True)
    shardsync.save_dcp(state, out / "dcp", MAPPING, overwrite=True)
    res["through the orchestrator"] = len(prepared)
    return res


def _check_outputs(out: Path) -> list[str]:
    files = sorted(p.name for p in (out / "hf").iterdir())
    back = {k: v for f in (out / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(back) == sorted(_expected())
    for k, v in _expected().items():
        assert torch.equal(back[k], v.bfloat16()), k
    loaded = {k: torch.empty_like(v) for k, v in _expected().items()}
    dcp.load(loaded, checkpoint_id=str(out / "dcp"), no_dist=True)
    for k, v in _expected().items():
        assert torch.equal(loaded[k], v), k
    return files


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict, list[str], Path]]:
    done = {}
    one = tmp_path_factory.mktemp("w1")
    done[1] = ({0: _every_verb(0, 1, str(one))}, _check_outputs(one), one)
    for world in (2, 4):
        d = tmp_path_factory.mktemp(f"w{world}")
        results = run_ranks(_every_verb, world, str(d), timeout=300)
        done[world] = (results, _check_outputs(d), d)
    return done


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_verb_runs_through_the_orchestrator(outputs: dict, world: int) -> None:
    results, _, _ = outputs[world]
    for rank in range(world):
        r = results[rank]
        assert r["full_params"] and r["fast path"] and r["load"] and r["reshard"], (rank, r)
        assert r["plan"] == ("b", "norm", "w_t")
        # full_params x2, plan, load, reshard x2, save_hf, save_dcp (the drifted call fails before)
        assert r["through the orchestrator"] == 8, (rank, r)
        if world > 1:
            assert r["drift"] == "replicas differ:", (rank, r["drift"])


def test_the_files_do_not_depend_on_the_number_of_ranks(outputs: dict) -> None:
    names = {world: files for world, (_, files, _) in outputs.items()}
    assert names[1] == names[2] == names[4] and len(names[1]) > 2  # several files, one index
    for f in names[1]:
        one = (outputs[1][2] / "hf" / f).read_bytes()
        assert all((outputs[w][2] / "hf" / f).read_bytes() == one for w in (2, 4)), f


# -- the phase table ------------------------------------------------------------------------------------


def test_every_phase_is_named_in_the_table_and_only_there() -> None:
    values = list(phases.PHASES.values())
    assert len(values) == len(set(values))
    assert {phases.CHECK, phases.GATHER, phases.PLAN, phases.STREAM, phases.LOAD, phases.RESHARD} == {
        "check layout",
        "gather layout",
        "plan",
        "stream",
        "load",
        "reshard",
    }
    assert all(getattr(phases, name) == value for name, value in phases.PHASES.items())
    literal = re.compile(r"\b(agree|data_phase|abandon|RollCall\.enter)\(\s*f?[\"']")
    offenders = [
        f"{p.relative_to(SRC)}:{i}"
        for p in SRC.rglob("*.py")
        if p.name != "phases.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if literal.search(line) and not line.lstrip().startswith((">>>", "..."))
    ]
    assert offenders == []


def test_the_old_phase_constants_are_the_table_s() -> None:
    from shardsync import stream
    from shardsync.destinations import transfer
    from shardsync.exec import STREAM_PHASE

    assert (stream.GATHER_PHASE, stream.PLAN_PHASE, STREAM_PHASE) == (phases.GATHER, phases.PLAN, phases.STREAM)
    assert (transfer.CHECK_PHASE, transfer.LOAD_PHASE, transfer.RESHARD_PHASE) == (
        phases.CHECK,
        phases.LOAD,
        phases.RESHARD,
    )


# -- the options type ----------------------------------------------------------------------------------


def test_options_are_one_frozen_checked_value() -> None:
    o = Options.of(None, memory_budget="1KiB", strategy="p2p", verify=True, quantize="fp8")
    assert (o.plan.memory_budget, o.plan.strategy, o.verify, o.quantize) == (1024, "p2p", True, Fp8Quantize())
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.verify = False  # type: ignore[misc]
    assert Options.of(None) == Options(PlanOptions(backend="none"))  # equal options: one plan cache key
    assert hash(Options.of(None, memory_budget=64)) == hash(Options.of(None, memory_budget="64"))
    with pytest.raises(PlanError, match="transport='tcp'"):
        Options.of(None, transport="tcp")
    with pytest.raises(PlanError, match="reuse='sometimes'"):
        Options.of(None, reuse="sometimes")
    with pytest.raises(LayoutError, match="replica_check"):
        Options.of(None, replica_check="some")
    with pytest.raises(FormatError, match="cannot read size 'lots'"):
        Options.of(None, memory_budget="lots")


def test_every_verb_checks_its_options_when_called(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    with pytest.raises(PlanError, match="transport='tcp'"):
        shardsync.full_params(state, transport="tcp")  # not iterated: raised by the call
    with pytest.raises(PlanError, match="transport='tcp'"):
        shardsync.load({"w": torch.zeros(3)}, state, transport="tcp")
    with pytest.raises(PlanError, match="quantize='int4'"):
        shardsync.save_hf(state, tmp_path / "hf", quantize="int4")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="cannot read size 'lots'"):
        shardsync.save_dcp(state, tmp_path / "dcp", memory_budget="lots")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "dcp").exists()


# -- deprecated names ----------------------------------------------------------------------------------


def test_save_hf_s_old_argument_names_warn_and_write_the_same_files(tmp_path: Path) -> None:
    state = {"a": arange_tensor((9,)), "b": arange_tensor((4, 3)), "c": arange_tensor((5,))}
    shardsync.save_hf(state, tmp_path / "new", max_file_size=40)
    with pytest.warns(DeprecationWarning, match=r"out_dir=.*deprecated") as warned:
        with pytest.warns(DeprecationWarning, match=r"max_shard_size=.*deprecated"):
            shardsync.save_hf(state, out_dir=tmp_path / "old", max_shard_size=40)
    assert {w.filename for w in warned} == {__file__}  # the warnings point at the caller's line
    new = sorted((tmp_path / "new").iterdir())
    assert [p.name for p in new] == sorted(p.name for p in (tmp_path / "old").iterdir()) and len(new) > 2
    assert all(p.read_bytes() == (tmp_path / "old" / p.name).read_bytes() for p in new)
    with pytest.raises(PlanError, match="max_file_size= only"):
        with pytest.warns(DeprecationWarning):
            shardsync.save_hf(state, tmp_path / "x", max_file_size=40, max_shard_size=40)


# -- file ownership ------------------------------------------------------------------------------------


def test_files_get_writers_before_anything_moves() -> None:
    t = [TargetSpec(n, (4,), "float32", ()) for n in "abcdef"]
    owners = file_owners(t, limit=32, cast=None, fp8=None, world=3)  # files ab | cd | ef
    assert owners == ((0,), (0,), (1,), (1,), (2,), (2,))
    planned = [TargetPlan(x.name, x.shape, x.dtype, o, ()) for x, o in zip(t, owners)]
    assert plan_files(planned, 32).writers == (0, 1, 2)
    stray = [TargetPlan(x.name, x.shape, x.dtype, (i % 2,), ()) for i, x in enumerate(t)]
    with pytest.raises(PlanError, match=r"targets \['b', 'd', 'f'\] are received by another rank"):
        plan_files(stray, 32)


def test_a_quantised_weight_and_its_scales_keep_one_writer() -> None:
    # the codes fill file 1 exactly; their scales open file 2: both files go to one writer
    t = [
        TargetSpec("a.weight", (256, 256), "float32", ()),
        TargetSpec("b.bias", (8,), "float32", ()),
        TargetSpec("c.bias", (16384,), "float32", ()),
    ]
    fp8 = Fp8Quantize()
    assert file_owners(t, limit=256 * 256, cast=None, fp8=fp8, world=2) == ((0,), (0,), (1,))
    planned = [TargetPlan(x.name, x.shape, x.dtype, o, ()) for x, o in zip(t, file_owners(t, 256 * 256, None, fp8, 2))]
    files = plan_files(planned, 256 * 256, None, fp8)
    assert files.files == (("a.weight",), ("a.weight_scale_inv", "b.bias"), ("c.bias",))
    assert files.writers == (0, 0, 1)


# -- sources the verbs open, they close ----------------------------------------------------------------


def test_a_checkpoint_opened_from_a_path_is_closed_by_the_verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardsync.sources import SafetensorsSource

    shardsync.save_hf({"w": arange_tensor((4, 3)), "b": arange_tensor((5,))}, tmp_path / "ck")
    closed: list[str] = []
    real = SafetensorsSource.close
    monkeypatch.setattr(SafetensorsSource, "close", lambda self: (closed.append("x"), real(self))[1])
    assert [n for n, _ in shardsync.full_params(tmp_path / "ck")] == ["b", "w"] and len(closed) == 1
    stream = shardsync.full_params(tmp_path / "ck")
    for _ in stream:
        break
    stream.close()  # left early: closed all the same
    assert len(closed) == 2
    shardsync.load({"w": torch.zeros(4, 3), "b": torch.zeros(5)}, tmp_path / "ck")
    shardsync.plan(tmp_path / "ck")
    assert len(closed) == 4
    source = SafetensorsSource(tmp_path / "ck")  # a source the caller opened is the caller's to close
    _ = [t for _, t in shardsync.full_params(source)]
    assert len(closed) == 4


def test_the_fp8_block_comes_from_the_sources_and_must_agree() -> None:
    from shardsync.layout import local_layout
    from shardsync.stream import ToConsumers

    codes = torch.zeros(4, 6).to(torch.float8_e4m3fn)
    mine = tuple(local_layout({"w": codes, "w_scale_inv": torch.ones(2, 2)}))
    ranks = [pipeline._RankLayout(mine, (), None, (2, 3)), pipeline._RankLayout(mine, (), None, (2, 3))]
    planned = pipeline._planned(ToConsumers.plan, tuple(ranks), None, PlanOptions(), "whole targets", False)
    # the scales follow the block: a [4, 6] weight in blocks of [2, 3] has [2, 2] scales, one target
    assert [t.name for t in planned.plan.targets] == ["w", "w_scale_inv"]
    ranks[1] = pipeline._RankLayout(mine, (), None, (128, 128))
    with pytest.raises(PlanError, match=r"different blocks \[\(2, 3\), \(128, 128\)\]"):
        pipeline._planned(ToConsumers.plan, tuple(ranks), None, PlanOptions(), "whole targets", False)
