"""The command line on small checkpoints of each format: convert/export, inspect, plan, diff, explain.

Commands run in process through ``main([...])``; outputs are checked against hand-written references
(``cli_checkpoints``), tables and JSON exactly.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import shardsync
from cli_checkpoints import MAPPING, Checkpoints, build, mapped, state
from shardsync.cli import main
from shardsync.cli.common import MappingFlags
from shardsync.cli.plan import PlanConfig, dry_run


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build(tmp_path_factory.mktemp("ckpts"))


def _hf(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("fmt", ["single", "sharded", "dcp"])
def test_convert_to_hf_from_each_format(
    ck: Checkpoints, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert main(["convert", str(ck.all[fmt]), str(out), "-m", str(ck.mapping), "--max-shard-size", "300B"]) == 0
    _assert_same(_hf(out), mapped())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.embed"] == "model-00001-of-00003.safetensors"
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(
        rf"wrote 9 tensors \(840 B\) in 3 files to {re.escape(str(out))} in [\d.]+ s "
        r"\([\d.]+ [KMG]?B/s\)",
        line,
    ), line


def test_convert_to_dcp_with_dtype_reads_back(ck: Checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    assert (
        main(["convert", str(ck.sharded), str(out), "--to", "dcp", "-m", str(ck.mapping), "--dtype", "bf16", "-q"]) == 0
    )
    want = {k: v.to(torch.bfloat16) for k, v in mapped().items()}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=out, no_dist=True)  # torch's own reader
    _assert_same(got, want)
    assert main(["convert", str(out), str(tmp_path / "back"), "-q"]) == 0  # and back to HF, unmapped
    _assert_same(_hf(tmp_path / "back"), want)


def test_export_is_convert_to_hf(ck: Checkpoints, tmp_path: Path) -> None:
    assert main(["export", str(ck.dcp), str(tmp_path / "e"), "-m", str(ck.mapping), "-q"]) == 0
    assert main(["convert", str(ck.dcp), str(tmp_path / "c"), "-m", str(ck.mapping), "--to", "hf", "-q"]) == 0
    assert (tmp_path / "e/model.safetensors").read_bytes() == (tmp_path / "c/model.safetensors").read_bytes()


def test_config_json_follows_the_weights(ck: Checkpoints, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ck.single, src)
    (src / "config.json").write_text('{"torch_dtype": "float32", "hidden_size": 5}')
    (src / "tokenizer.json").write_text("{}")
    assert main(["convert", str(src), str(tmp_path / "same"), "--dtype", "bf16", "-q"]) == 0
    assert json.loads((tmp_path / "same/config.json").read_text()) == {"torch_dtype": "bfloat16", "hidden_size": 5}
    assert (tmp_path / "same/tokenizer.json").read_text() == "{}"
    # a mapping renames the tensors: the source's config is not the output's unless asked for
    assert main(["convert", str(src), str(tmp_path / "mapped"), "-m", str(ck.mapping), "-q"]) == 0
    assert not (tmp_path / "mapped/config.json").exists()
    assert (
        main(["convert", str(src), str(tmp_path / "asked"), "-m", str(ck.mapping), "-q", "--config-from", str(src)])
        == 0
    )
    assert (tmp_path / "asked/config.json").is_file()


def test_overwrite_replaces(ck: Checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main(["convert", str(ck.single), str(out), "-q"]) == 0
    assert main(["convert", str(ck.single), str(out), "-q", "-m", str(ck.mapping), "--overwrite"]) == 0
    _assert_same(_hf(out), mapped())


def _inspect_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _tensor(shape: list[int], dtype: str, nbytes: int, shards: list[tuple[list[int], list[int], str]]) -> dict:
    return {
        "shape": shape,
        "dtype": dtype,
        "bytes": nbytes,
        "shards": [{"offsets": o, "sizes": s, "file": f} for o, s, f in shards],
    }


def test_inspect_json_safetensors(ck: Checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    f = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    want = {
        "path": str(ck.sharded),
        "format": "safetensors",
        "files": [{"name": n, "bytes": (ck.sharded / n).stat().st_size} for n in f],
        "num_tensors": 5,
        "total_bytes": 340 + 2 * 240 + 2 * 10,
        "tensors": {
            "embed": _tensor([17, 5], "float32", 340, [([0, 0], [17, 5], f[0])]),
            "layers.0.norm": _tensor([5], "bfloat16", 10, [([0], [5], f[0])]),
            "layers.0.qkv": _tensor([12, 5], "float32", 240, [([0, 0], [12, 5], f[1])]),
            "layers.1.norm": _tensor([5], "bfloat16", 10, [([0], [5], f[1])]),
            "layers.1.qkv": _tensor([12, 5], "float32", 240, [([0, 0], [12, 5], f[2])]),
        },
    }
    assert _inspect_json(ck.sharded, capsys) == want
    single = _inspect_json(ck.single, capsys)
    assert single["files"] == [{"name": "model.safetensors", "bytes": (ck.single / "model.safetensors").stat().st_size}]
    assert {k: t["shards"][0]["file"] for k, t in single["tensors"].items()} == dict.fromkeys(
        want["tensors"], "model.safetensors"
    )


def test_inspect_json_dcp(ck: Checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    (data,) = [p.name for p in ck.dcp.glob("*.distcp")]
    halves = lambda cols: [([0, 0], [9, cols], data), ([9, 0], [8, cols], data)]  # noqa: E731
    sixes = [([0, 0], [6, 5], data), ([6, 0], [6, 5], data)]
    want = {
        "path": str(ck.dcp),
        "format": "dcp",
        "files": [{"name": data, "bytes": (ck.dcp / data).stat().st_size}],
        "num_tensors": 5,
        "total_bytes": 840,
        "tensors": {
            "embed": _tensor([17, 5], "float32", 340, halves(5)),
            "layers.0.norm": _tensor([5], "bfloat16", 10, [([0], [5], data)]),
            "layers.0.qkv": _tensor([12, 5], "float32", 240, sixes),
            "layers.1.norm": _tensor([5], "bfloat16", 10, [([0], [5], data)]),
            "layers.1.qkv": _tensor([12, 5], "float32", 240, sixes),
        },
    }
    assert _inspect_json(ck.dcp, capsys) == want


def test_inspect_table_folds_layers(ck: Checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ck.sharded)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{ck.sharded}: safetensors checkpoint, 5 tensors, 840 B in 3 files",
        "tensor             n  shape    dtype     shards  files                             bytes",
        "embed              1  [17, 5]  float32        1  model-00001-of-00003.safetensors  340 B",
        "layers.{0,1}.norm  2  [5]      bfloat16       1  2 files                            20 B",
        "layers.{0,1}.qkv   2  [12, 5]  float32        1  2 files                           480 B",
    ]


def test_plan_is_the_plan_convert_runs(ck: Checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = PlanConfig(ck.dcp, MappingFlags(str(ck.mapping)))
    streamed = shardsync.plan(ck.dcp, MAPPING, split_by="bytes", copy=False)
    assert dry_run(cfg) == streamed
    assert main(["plan", str(ck.dcp), "-m", str(ck.mapping), "--nproc", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"plan: {ck.dcp} with 2 workers: 9 targets (840 B), strategy p2p, 1 step"
    assert lines[1].split() == ["target", "n", "shape", "dtype", "pieces", "from", "worker", "bytes"]
    assert lines[2].split() == ["model.embed", "1", "[17,", "5]", "float32", "2", "embed", "0", "340", "B"]
    assert lines[-3].split() == ["worker", "reads", "writes", "sends", "receives", "collectives", "peak", "memory"]


def test_plan_json_partitions_targets(ck: Checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ck.sharded), "-m", str(ck.mapping), "--nproc", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workers"] == 3 and [t["name"] for t in doc["targets"]] == sorted(mapped())
    got = {t["name"]: t for t in doc["targets"]}
    for name, t in got.items():  # one worker each, and the pieces tile the target
        assert len(t["workers"]) == 1
        covered = sum(torch.Size(p["target_box"]["sizes"]).numel() for p in t["pieces"])
        assert covered == mapped()[name].numel()
    assert [p["source"] for p in got["model.layers.1.v"]["pieces"]] == ["layers.1.qkv"]
    assert got["model.layers.1.v"]["pieces"][0]["source_box"] == {"offsets": [9, 0], "sizes": [3, 5]}
    per = doc["per_worker"]
    assert sum(w["writes_bytes"] for w in per) == 840
    assert sum(w["reads_bytes"] for w in per) == 840  # every source box read once, by one worker
    assert sum(w["sent_bytes"] for w in per) == sum(w["received_bytes"] for w in per)


def _modified(ck: Checkpoints, tmp_path: Path) -> Path:
    s = state()
    s["layers.1.qkv"][3, 4] += 0.5
    s["extra"] = torch.zeros(3)
    del s["embed"]
    s["layers.0.norm"] = s["layers.0.norm"].float()
    s["layers.0.qkv"] = s["layers.0.qkv"].reshape(6, 10)
    tmp_path.mkdir()
    save_file(s, tmp_path / "model.safetensors")
    return tmp_path


def test_diff(ck: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(ck.dcp), str(ck.sharded)]) == 0
    assert capsys.readouterr().out == "equal: 5 tensors, max abs diff 0\n"
    assert main(["convert", str(ck.dcp), str(tmp_path / "hf"), "-m", str(ck.mapping), "-q"]) == 0
    # how a conversion is verified
    assert main(["diff", str(ck.dcp), str(tmp_path / "hf"), "-m", str(ck.mapping)]) == 0
    assert capsys.readouterr().out == "equal: 9 tensors, max abs diff 0\n"
    other = _modified(ck, tmp_path / "other")
    assert main(["diff", str(ck.single), str(other)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "only in A (1): embed",
        "only in B (1): extra",
        "dtype differs: layers.0.norm bfloat16 in A, float32 in B (max abs diff 0)",
        "shape differs: layers.0.qkv [12, 5] in A, [6, 10] in B",
        "values differ: layers.1.qkv max abs diff 0.5 > --atol 0",
        "differ: 3 of 4 common tensors, 1 only in A, 1 only in B",
    ]
    assert main(["diff", str(ck.single), str(other), "--json", "--atol", "1"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"]["layers.1.qkv"] == {
        "status": "equal",
        "shape_a": [12, 5],
        "shape_b": [12, 5],
        "dtype_a": "float32",
        "dtype_b": "float32",
        "max_abs_diff": 0.5,
    }
    assert (doc["equal"], doc["only_in_a"], doc["only_in_b"]) == (False, ["embed"], ["extra"])
    assert doc["tensors"]["layers.0.qkv"]["max_abs_diff"] is None
    assert main(["diff", str(ck.single), str(other), "-q"]) == 1 and capsys.readouterr().out == ""


def test_diff_within_atol(ck: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = state()
    s["embed"][16, 4] -= 0.25
    save_file(s, tmp_path / "model.safetensors")
    assert main(["diff", str(ck.dcp), str(tmp_path), "--atol", "0.25"]) == 0
    assert capsys.readouterr().out == "equal: 5 tensors, max abs diff 0.25 (within --atol 0.25)\n"
    assert main(["diff", str(ck.dcp), str(tmp_path), "--atol", "0.2"]) == 1
    half = tmp_path / "half"
    assert main(["convert", str(ck.dcp), str(half), "--dtype", "fp16", "-q"]) == 0
    capsys.readouterr()
    assert main(["diff", str(ck.dcp), str(half)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "differ: 5 of 5 common tensors, 0 only in A, 0 only in B"
    assert main(["diff", str(ck.dcp), str(half), "--ignore-dtype"]) == 0  # every value fits fp16 exactly


def test_explain(ck: Checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(ck.dcp), "-m", str(ck.mapping)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        "model.embed  [17, 5] float32  (1 piece from embed)",
        "    embed[0:17, 0:5] -> [0:17, 0:5]",
        "model.layers.0.k  [3, 5] float32  (1 piece from layers.0.qkv)",
    ]


def test_version_and_module_entry_point(ck: Checkpoints) -> None:
    run = subprocess.run([sys.executable, "-m", "shardsync", "--version"], capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (0, f"shardsync {shardsync.__version__}\n")
    run = subprocess.run([sys.executable, "-m", "shardsync", "inspect", str(ck.single)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.splitlines()[0].endswith("5 tensors, 840 B in 1 file")
