"""Digests on 2 and 4 gloo processes (tier 2): TP=2 live Megatron shards under the mapping == the HF
files written from them == a DCP copy written by 4 ranks in another layout, read by 4, 2 and 1
processes; replicas counted once; two all_gather_object calls and no data; errors on every rank;
``verify=True`` of reshard and full_params naming what a bad rank wrote or received.

The reference is the dense HF state the shards were cut from, hashed whole in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dest_helpers import MAPPING, hf_shards, hf_state, megatron_shards
from multiproc import run_ranks
from shardsync import digest, full_params, load, reshard, save, save_hf, verify
from shardsync.errors import DistributedError, LayoutError, PlanError, VerifyError
from shardsync.exec import executor
from shardsync.exec.box_hash import tensor_digest


def _want() -> dict[str, str]:
    return {k: tensor_digest(v) for k, v in sorted(hf_state().items())}


def _zeros(rank: int, world: int) -> dict[str, Any]:
    return hf_shards({k: torch.zeros_like(v) for k, v in hf_state().items()}, rank, world)


def _catch(fn: Any) -> str:
    try:
        fn()
    except (DistributedError, LayoutError, PlanError, VerifyError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _corrupt_on_this_rank(key_part: str) -> None:
    """From now on, pieces of sources whose key contains ``key_part`` land with one element changed."""
    real = executor.copy_piece

    def copy_piece(out: torch.Tensor, data: torch.Tensor, origin: Any, piece: Any, *later: Any) -> None:
        real(out, data, origin, piece)  # now, not with the batch: the change below lands after it
        if key_part in piece.source:
            region = out[piece.target_box.slices()]
            region[(0,) * region.dim()] += 1

    executor.copy_piece = copy_piece  # type: ignore[assignment]  # this spawned process only
    executor.copy_bits = lambda *args: False  # pushed pieces through copy_piece above too


def _collectives(fn: Any) -> tuple[Any, dict[str, int]]:
    """``fn()`` and the torch.distributed calls it made, by name."""
    names = (
        "all_gather_object",
        "broadcast_object_list",
        "broadcast",
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
    )
    counts: dict[str, int] = {}
    real = {n: getattr(dist, n) for n in names}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, counted(n))
    try:
        return fn(), counts
    finally:
        for n in names:
            setattr(dist, n, real[n])


def _two(rank: int, world: int, tmp: str) -> dict[str, Any]:
    want, mine = _want(), megatron_shards(hf_state(), rank, 2)
    got, calls = _collectives(lambda: digest(mine, MAPPING))
    out: dict[str, Any] = {"live": got == want, "collectives": calls}
    save_hf(mine, Path(tmp) / "hf", MAPPING)
    out["hf"] = digest(Path(tmp) / "hf") == want
    out["verify"] = verify(mine, Path(tmp) / "hf", MAPPING).ok
    stream = full_params(mine, MAPPING, verify=True)
    got = {name: tensor_digest(t) for name, t in stream}
    out["stream"] = stream.digests == want and got == want
    dst = _zeros(rank, 2)
    load(dst, Path(tmp) / "hf", verify=True)
    out["load"] = digest(dst) == want
    out["mappings"] = _catch(lambda: digest(mine, MAPPING if rank == 0 else None))
    out["module"] = _catch(lambda: digest(torch.nn.Linear(2, 2) if rank == 1 else mine))  # type: ignore[arg-type]
    if rank == 1:
        _corrupt_on_this_rank("linear_proj")
    out["corrupt"] = _catch(lambda: reshard(mine, _zeros(rank, 2), MAPPING, verify=True))
    out["stream corrupt"] = _catch(lambda: [n for n, _ in full_params(mine, MAPPING, verify=True)])
    return out


def _four(rank: int, world: int, tmp: str) -> dict[str, bool]:
    want = _want()
    dst = _zeros(rank, 4)
    load(dst, Path(tmp) / "hf", verify=True)
    save(dst, Path(tmp) / "dcp4")
    replicas = megatron_shards(hf_state(), rank % 2, 2)  # TP=2 x DP=2: ranks r and r + 2 hold replicas
    return {
        "live": digest(dst) == want,
        "dcp": digest(Path(tmp) / "dcp4") == want,
        "replicas": digest(replicas, MAPPING) == want,
    }


def _again(rank: int, world: int, tmp: str) -> dict[str, bool]:
    want = _want()
    return {
        "dcp4 on 2": digest(Path(tmp) / "dcp4") == want,
        "hf on 2": digest(Path(tmp) / "hf") == want,
        "verify": verify(Path(tmp) / "dcp4", Path(tmp) / "hf").ok,
    }


def test_digests_agree_across_layouts_formats_and_rank_counts(tmp_path: Path) -> None:
    two = run_ranks(_two, 2, str(tmp_path), timeout=300)
    for r in two:
        assert {k: r[k] for k in ("live", "hf", "verify", "stream", "load")} == dict.fromkeys(
            ("live", "hf", "verify", "stream", "load"), True
        )
        assert r["collectives"] == {"all_gather": 2}  # the layout, then one integer per tensor: small, one each
        assert r["mappings"].startswith("PlanError: ranks passed different mappings to digest")
        assert r["module"].startswith("DistributedError: phase 'digest: gather layout' failed on rank(s) [1]")
        assert "got a module (Linear)" in r["module"]
        o_proj = ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"]
        assert r["corrupt"].startswith(f"VerifyError: verify: 2 tensor(s) written differ from the source: {o_proj}")
        assert "on rank 0" not in r["corrupt"] and "on rank 1" in r["corrupt"]
        assert r["stream corrupt"].startswith(
            f"VerifyError: verify: 2 target(s) received differ from the senders' digest (rank 1: {o_proj})"
        )
    assert two[0]["corrupt"] == two[1]["corrupt"] and two[0]["stream corrupt"] == two[1]["stream corrupt"]
    assert run_ranks(_four, 4, str(tmp_path), timeout=300) == [{"live": True, "dcp": True, "replicas": True}] * 4
    assert (
        run_ranks(_again, 2, str(tmp_path), timeout=300)
        == [dict.fromkeys(("dcp4 on 2", "hf on 2", "verify"), True)] * 2
    )
    want = _want()
    assert digest(tmp_path / "dcp4") == want and digest(tmp_path / "hf") == want  # one process
