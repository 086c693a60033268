"""``verify=True`` of load, reshard and full_params, and ``shardsync verify`` (tier 1).

A corrupted transfer is simulated by wrapping the executor's ``copy_piece``: after the real copy, one
element of what landed is changed, as a bad transport or a concurrent writer would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsync
from reference import arange_tensor
from shardsync.cli import main
from shardsync.errors import VerifyError
from shardsync.exec import executor
from shardsync.exec.box_hash import tensor_digest
from shardsync.layout import LocalShard, shard_dim
from shardsync.mapping.pieces import Piece


@pytest.fixture
def corrupt(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Pieces of the source keys put in the yielded set land with their first element changed."""
    keys: set[str] = set()
    real = executor.copy_piece

    def copy_piece(out: torch.Tensor, data: torch.Tensor, origin: Any, piece: Piece, *later: Any) -> None:
        real(out, data, origin, piece)  # now, not with the batch: the change below lands after it
        if piece.source in keys:
            region = out[piece.target_box.slices()]
            region[(0,) * region.dim()] += 1

    monkeypatch.setattr(executor, "copy_piece", copy_piece)
    monkeypatch.setattr(executor, "copy_bits", lambda *args: False)  # pushed pieces through copy_piece too
    yield keys


def _state() -> dict[str, torch.Tensor]:
    return {"a": arange_tensor((17, 5), step=0.37), "b": arange_tensor((7, 3), start=50)}


def _dest() -> dict[str, Any]:
    return {
        "a_t": [LocalShard(torch.zeros(2, 17), (5, 17), (0, 0)), LocalShard(torch.zeros(3, 17), (5, 17), (2, 0))],
        "b_t": torch.zeros(3, 7),
    }


MAP = ["a^T -> a_t", "b^T -> b_t"]


def test_load_and_reshard_verify_pass_when_the_transfer_is_right() -> None:
    dst = _dest()
    shardsync.load(dst, _state(), MAP, verify=True)
    assert torch.equal(torch.cat([s.local for s in dst["a_t"]]), _state()["a"].T)
    again = _dest()
    shardsync.reshard(_state(), again, MAP, verify=True)
    assert torch.equal(again["b_t"], _state()["b"].T)


def test_load_verify_names_the_tensor_a_bad_transfer_wrote(corrupt: set[str]) -> None:
    corrupt.add("b")
    shardsync.load(_dest(), _state(), MAP)  # without verify the damage goes unnoticed
    with pytest.raises(
        VerifyError,
        match=r"1 tensor\(s\) written differ .*\['b_t'\]: 'b_t' box \[0:3, 0:7\] "
        r"on rank 0",
    ) as info:
        shardsync.load(_dest(), _state(), MAP, verify=True)
    assert info.value.tensors == ("b_t",)


def test_reshard_verify_names_every_bad_box(corrupt: set[str]) -> None:
    corrupt.add("a")
    with pytest.raises(
        VerifyError,
        match=r"\['a_t'\]: 'a_t' box \[0:2, 0:17\] on rank 0; 'a_t' box "
        r"\[2:5, 0:17\] on rank 0",
    ):
        shardsync.reshard(_state(), _dest(), MAP, verify=True)


@pytest.mark.parametrize("bad", ["a", "c"])
def test_verify_checks_each_copy_of_a_target_built_of_several(corrupt: set[str], bad: str) -> None:
    # local copies are compared bit for bit and the equal ones left out of both sums: the bad one is
    # still hashed on both sides, in the frame of the destination box
    state = {"a": arange_tensor((17, 5), step=0.37), "c": arange_tensor((4, 5), start=90)}
    dst = {"ac": torch.zeros(21, 5)}
    shardsync.reshard(state, dst, ["a, c -> ac, axis=0"], verify=True)
    assert torch.equal(dst["ac"], torch.cat([state["a"], state["c"]]))
    corrupt.add(bad)
    with pytest.raises(VerifyError, match=r"\['ac'\]: 'ac' box \[0:21, 0:5\] on rank 0"):
        shardsync.reshard(state, {"ac": torch.zeros(21, 5)}, ["a, c -> ac, axis=0"], verify=True)


def test_stream_digests_are_the_senders_and_match_digest() -> None:
    state = {"a": [shard_dim(_state()["a"], 0, r, 2) for r in range(2)], "b": _state()["b"]}
    stream = shardsync.full_params(state, MAP, verify=True)
    assert stream.digests is None
    got = {name: tensor_digest(t) for name, t in stream}
    assert stream.digests == got == shardsync.digest(state, MAP)
    assert shardsync.full_params(state, MAP).digests is None


def test_stream_verify_raises_after_the_last_target(corrupt: set[str]) -> None:
    corrupt.add("a")
    seen = []
    with pytest.raises(VerifyError, match=r"1 target\(s\) received differ .*rank 0: \['a_t'\]"):
        for name, _ in shardsync.full_params(_state(), MAP, verify=True):
            seen.append(name)
    assert seen == ["a_t", "b_t"]
    assert [n for n, _ in shardsync.full_params(_state(), MAP)] == ["a_t", "b_t"]  # no check, no error


# -- the command ----------------------------------------------------------------------------------------


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    state = _state()
    shardsync.save_safetensors(state.items(), tmp_path / "a")
    shardsync.save({k: v.T.contiguous() for k, v in state.items()}, tmp_path / "t_dcp")
    bumped = state["a"].T.contiguous()
    bumped.view(torch.int32)[4, 16] += 1  # one ulp
    shardsync.save_safetensors([("a", bumped), ("b", state["b"].T.contiguous())], tmp_path / "t_ulp")
    shardsync.save_safetensors([("a", state["a"])], tmp_path / "only_a")
    return tmp_path


def test_cli_verify_exit_codes(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, dcp, ulp = str(ckpts / "a"), str(ckpts / "t_dcp"), str(ckpts / "t_ulp")
    transpose = ["--mapping", "a^T -> a\nb^T -> b"]
    assert main(["verify", a, dcp, *transpose]) == 0
    assert capsys.readouterr().out == "equal: 2 tensors, every digest matches\n"
    assert main(["verify", a, ulp, *transpose]) == 1
    assert capsys.readouterr().out == ("different (1): a\ndiffer: 1 different, 1 equal, 0 only in A, 0 only in B\n")
    assert main(["verify", a, str(ckpts / "only_a")]) == 1
    assert capsys.readouterr().out == "only in A (1): b\ndiffer: 0 different, 1 equal, 1 only in A, 0 only in B\n"
    assert main(["verify", a, str(ckpts / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err


def test_cli_verify_json(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, ulp = str(ckpts / "a"), str(ckpts / "t_ulp")
    assert main(["verify", a, ulp, "--mapping", "a^T -> a\nb^T -> b", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    want_b = tensor_digest(_state()["b"].T.contiguous())
    assert doc["ok"] is False and doc["a"] == a and doc["b"] == ulp
    assert doc["tensors"]["b"] == {"status": "equal", "a": want_b, "b": want_b}
    assert doc["tensors"]["a"]["status"] == "different"
    assert doc["tensors"]["a"]["a"] == tensor_digest(_state()["a"].T.contiguous())


def test_cli_verify_mistakes_are_one_line(ckpts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = str(ckpts / "a")
    assert main(["verify", a, str(ckpts / "t_dcp"), "--mapping", "nope -> x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardsync verify: ") and "nope" in err and "\n" not in err
    assert main(["verify", a]) == 2
    assert "the following arguments are required: B" in capsys.readouterr().err
