"""``convert --prefix`` and ``--keys`` on a torch DCP app state ``{"model": ..., "optim": ...}``: the
model's tensors under their own names, the optimizer's left out, exact; a prefix or pattern that
matches no key is an error naming the keys there are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from reference import arange_tensor
from shardsync.cli import main

MODEL = {
    "layers.0.mlp.w": arange_tensor((17, 3)),
    "layers.1.mlp.w": arange_tensor((17, 3), start=100),
    "embed.weight": arange_tensor((5, 3), start=-20),
}


@pytest.fixture(scope="module")
def app_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "step_10"
    optim = {
        "state": {k: {"exp_avg": v + 0.5, "step": torch.tensor(10.0)} for k, v in MODEL.items()},
        "param_groups": [{"lr": 1e-3, "params": list(MODEL)}],
    }
    dcp.save({"model": {k: v.clone() for k, v in MODEL.items()}, "optim": optim}, checkpoint_id=str(path))
    return path


def test_prefix_reads_the_model_of_an_app_state(app_state: Path, tmp_path: Path) -> None:
    assert main(["convert", str(app_state), str(tmp_path / "all"), "-q"]) == 0
    everything = load_file(tmp_path / "all" / "model.safetensors")
    assert "optim.state.embed.weight.exp_avg" in everything and "model.embed.weight" in everything
    assert main(["convert", str(app_state), str(tmp_path / "hf"), "--prefix", "model.", "-q"]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(MODEL)
    assert all(torch.equal(got[k], v) for k, v in MODEL.items())


def test_keys_and_a_mapping_apply_to_what_the_prefix_leaves(app_state: Path, tmp_path: Path) -> None:
    assert (
        main(
            [
                "convert",
                str(app_state),
                str(tmp_path / "hf"),
                "--prefix",
                "model.",
                "--keys",
                "model.layers.*",
                "--mapping",
                "layers.*.mlp.w -> mlp.w, stack",
                "-q",
            ]
        )
        == 0
    )
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert list(got) == ["mlp.w"]
    assert torch.equal(got["mlp.w"], torch.stack([MODEL["layers.0.mlp.w"], MODEL["layers.1.mlp.w"]]))


def test_a_prefix_that_matches_nothing_names_the_keys(
    app_state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(app_state), str(tmp_path / "hf"), "--prefix", "module.", "-q"]) != 0
    err = capsys.readouterr().err
    assert "no key of the checkpoint start with 'module.'" in err and "'embed.weight'" not in err
    assert "model.embed.weight" in err and "--prefix model." in err
    assert not (tmp_path / "hf").exists()
