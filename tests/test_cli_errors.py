"""Every user error of the command line: exit status 2 and exactly one line on stderr,
``shardsync <cmd>: <what is wrong> (<how to fix>)``, naming flags and never showing a traceback.

In process through ``main([...])`` (failures of the disk are simulated there), plus a few runs of
``python -m shardsync`` for the real exit status and stderr.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

import shardsync.io.safetensors_file as safetensors_file
from cli_checkpoints import Checkpoints, build
from shardsync.cli import main
from shardsync.cli.messages import one_line
from shardsync.errors import DistributedError


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    ck = build(tmp_path_factory.mktemp("ckpts"))
    r = ck.root
    (r / "bad.json").write_text('{"aoa_statements": ["a -> b",\n')
    (r / "bad.yaml").write_text("aoa_statements:\n  - [a\n")
    (r / "list.json").write_text('{"aoa_statements": 3}')
    (r / "a_file").write_text("not a directory")
    (r / "config.json").write_text("{}")
    (r / "truncated").mkdir()
    (r / "truncated/model.safetensors").write_bytes((ck.single / "model.safetensors").read_bytes()[:100])
    (r / "bad_dcp").mkdir()
    (r / "bad_dcp/.metadata").write_bytes(b"not a pickle")
    (r / "export_map.txt").write_text("layers.$LAYER_ID.qkv -> model.layers.$LAYER_ID.qkv\n")
    assert main(["convert", str(ck.single), str(r / "hf_out"), "-q"]) == 0
    assert main(["convert", str(ck.single), str(r / "dcp_out"), "--to", "dcp", "-q"]) == 0
    assert main(["convert", str(ck.single), str(r / "hf_mapped"), "-q", "-m", str(r / "export_map.txt")]) == 0
    return ck


# argv (with {root} for the checkpoints' directory) -> the line printed after "shardsync <cmd>: "
CASES = {
    "convert {root}/single {root}/o -m {root}/bad.json": "{root}/bad.json, line 2, column 1: invalid JSON: Expecting value (fix the mapping)",
    "convert {root}/single {root}/o -m {root}/bad.yaml": "{root}/bad.yaml, line 3, column 1: invalid YAML: expected ',' or ']', but got '<stream end>' "
    "(fix the mapping)",
    "convert {root}/single {root}/o -m {root}/list.json": "{root}/list.json: 'aoa_statements' must be a list of statement strings (int) (fix the mapping)",
    "convert {root}/single {root}/o -m {root}/missing.map": "mapping file '{root}/missing.map' does not exist (give the path of a .txt, .json or .yaml mapping "
    "file, a shipped mapping name, or statements such as 'a -> b')",
    "plan {root}/single -m nothing.txt": "mapping file 'nothing.txt' does not exist (give the path of a .txt, .json or .yaml mapping file, a "
    "shipped mapping name, or statements such as 'a -> b')",
    "convert {root}/single {root}/a_file": "{root}/a_file is a file, not a directory (choose a directory for the checkpoint)",
    "convert {root}/single {root}/a_file --to dcp": "{root}/a_file is a file, not a directory (choose a directory for the checkpoint)",
    "convert {root}/single {root}/hf_out": "{root}/hf_out already holds a checkpoint (model.safetensors) (pass --overwrite to replace it, or "
    "choose another directory)",
    "export {root}/dcp {root}/hf_out --nproc 2": "{root}/hf_out already holds a checkpoint (model.safetensors) (pass --overwrite to replace it, or "
    "choose another directory)",
    "convert {root}/single {root}/dcp_out --to dcp": "{root}/dcp_out already holds a DCP checkpoint (pass --overwrite to replace it, or choose another "
    "directory)",
    "convert {root}/single {root}/o --max-shard-size 5XB": "--max-shard-size '5XB' is not a size (write e.g. 5GB, 500MB or 512MiB)",
    "diff {root}/single {root}/dcp --memory-budget lots": "--memory-budget 'lots' is not a size (write e.g. 5GB, 500MB or 512MiB)",
    "convert {root}/single {root}/o --memory-budget 100B": "--memory-budget 100 B cannot be met: target 'embed' (340 B) is held whole while it is built "
    "(raise --memory-budget above 340 B (the smallest plan tried needs 340 B))",
    "convert {root}/dcp {root}/o --to dcp --memory-budget 700B --nproc 2": "--to dcp holds each worker's share of the targets until it is written (up to 490 B), which leaves "
    "less of --memory-budget 700 B than the largest target (340 B) to read and build them (use --nproc 3 "
    "or more, raise --memory-budget, or write --to hf)",
    "convert {root}/truncated {root}/o": "{root}/truncated/model.safetensors: header length 376 B runs past the end of the file (100 B) or "
    "beyond 100 MB; the file is truncated or not safetensors (check the checkpoint path)",
    "inspect {root}/bad_dcp": "{root}/bad_dcp/.metadata: cannot read DCP metadata (not written by "
    "torch.distributed.checkpoint.save?): UnpicklingError: invalid load key, 'n'. (check the checkpoint "
    "path)",
    "convert {root}/dcp/.metadata {root}/o": "{root}/dcp/.metadata is the metadata file of a DCP checkpoint (pass its directory {root}/dcp)",
    "diff {root}/config.json {root}/single": "{root}/config.json is not a checkpoint file (pass a .safetensors file, a *.safetensors.index.json, "
    "a directory of safetensors files, a torch DCP checkpoint directory (one holding .metadata), or a "
    "Megatron dist_checkpointing directory (metadata.json, common.pt))",
    "inspect {root}/nothing": "{root}/nothing does not exist (check the checkpoint path)",
    "convert {root}/single {root}/o --dtype int8": "--dtype 'int8' is not a floating dtype (use bf16, fp16, fp32 or a torch name such as bfloat16)",
    "convert {root}/single {root}/o --nproc 0": "--nproc 0 is not a number of local workers (give 1 to 256; for more ranks, start them with torchrun)",
    "convert {root}/single {root}/o --nproc 99999999999999999999": "--nproc 99999999999999999999 is not a number of local workers (give 1 to 256; for more ranks, "
    "start them with torchrun)",
    "plan {root}/single --nproc 257": "--nproc 257 is not a number of local workers (give 1 to 256; for more ranks, start them with "
    "torchrun)",
    "convert {root}/single {root}/o --to dcp --config-from {root}": "--config-from applies to --to hf only (drop --config-from, or write --to hf)",
    "convert {root}/single {root}/o --config-from {root}/dcp": "--config-from '{root}/dcp' holds no config.json (give the directory of a HuggingFace model "
    "(where save_pretrained wrote config.json))",
    "convert {root}/single {root}/o --set num_heads=2": "--set num_heads=2: the identity mapping (no --mapping) takes no parameters (give --mapping NAME "
    "of a shipped mapping, or remove --set)",
    "convert {root}/single {root}/o --set heads": "--set 'heads' is not key=value (write e.g. --set num_heads=32)",
    "diff {root}/single {root}/dcp --atol -1": "--atol -1.0 is not a tolerance (give 0 or a positive number)",
    "convert {root}/hf_mapped {root}/o -m {root}/export_map.txt": "the mapping does not fit the source's names as written, but does when run the other way "
    "(pass --reverse)",
    "convert {root}/single {root}/o -m {root}/export_map.txt --reverse": "the mapping does not fit the source's names as written, but does when run the other way "
    "(drop --reverse (or pass --no-reverse))",
    "plan {root}/single -m {root}/export_map.txt --strict": "no statement consumes 3 sources (embed, layers.0.norm, layers.1.norm) (map them, drop them with "
    "`NAME -> _`, or leave out --strict)",
    "explain {root}/single -m qkv->q": "statement 0 `qkv->q`, column 1: unknown name 'qkv' (fix the mapping)",
}


@pytest.mark.parametrize("argv, line", CASES.items(), ids=list(CASES))
def test_user_error_is_one_line(ck: Checkpoints, argv: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.format(root=ck.root) for a in argv.split()]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"shardsync {args[0]}: {line.format(root=ck.root)}\n"


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "a"]) == 2
    assert capsys.readouterr().err == (
        "shardsync convert: the following arguments are required: DST (see shardsync convert --help)\n"
    )
    assert main(["convert", "a", "b", "--to", "onnx"]) == 2
    assert capsys.readouterr().err.startswith("shardsync convert: argument --to: invalid choice: 'onnx'")
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_warning_for_unconsumed_sources(ck: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(ck.single), str(tmp_path / "o"), "-m", str(ck.root / "export_map.txt")]) == 0
    assert capsys.readouterr().err == (
        "shardsync convert: warning: no statement consumes 3 sources (embed, layers.0.norm, layers.1.norm): "
        "they pass through under their own names (--strict makes this an error)\n"
        f"shardsync convert: warning: save_hf: {tmp_path / 'o'} has no config.json, so from_pretrained will "
        "not load it; pass config_from=<the model's directory> (command line: --config-from DIR)\n"
    )
    assert main(["convert", str(ck.single), str(tmp_path / "q"), "-q", "-m", str(ck.root / "export_map.txt")]) == 0
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    "code, line",
    [
        (errno.ENOSPC, "no space left on the device of {file} (free some space, or write to another directory)"),
        (errno.EROFS, "{file} is on a read-only file system (write to another directory)"),
        (errno.EACCES, "permission denied: {file} (check its permissions, or choose another path)"),
    ],
)
def test_disk_errors(
    ck: Checkpoints,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    code: int,
    line: str,
) -> None:
    def fail(fd: int, data: object, offset: int) -> int:
        raise OSError(code, errno.errorcode[code])  # as the kernel reports it: no file named

    monkeypatch.setattr(safetensors_file.os, "pwrite", fail)  # what the writer thread calls for each tensor
    out = tmp_path / "o"
    assert main(["convert", str(ck.single), str(out)]) == 2
    err = capsys.readouterr().err
    (temp,) = [p for p in err.split() if p.startswith(str(out))][:1]
    assert err == f"shardsync convert: {line.format(file=temp)}\n"
    assert not out.exists()  # nothing left behind: not even the directory it created


def test_read_only_output_directory(
    ck: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["convert", str(ck.single), str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        f"shardsync convert: cannot create {tmp_path / 'o'}: Read-only file system (choose a writable directory)\n"
    )


def test_unexpected_errors_point_to_debug(
    ck: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("shardsync.cli.inspect.describe_checkpoint", broken)
    assert main(["inspect", str(ck.single)]) == 3
    assert capsys.readouterr().err == (
        "shardsync inspect: RuntimeError: boom (a bug; run with --debug for the traceback)\n"
    )
    assert main(["inspect", str(ck.single), "--debug"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "RuntimeError: boom" in err


def test_errors_from_workers_are_one_line() -> None:
    full = "OSError: [Errno 28] No space left on device: '/o/x'"
    same = DistributedError("save_hf: write files", {0: full, 1: full})
    assert one_line("convert", same) == (
        "shardsync convert: no space left on the device of /o/x (free some "
        "space, or write to another directory) (on worker 0, 1)",
        2,
    )
    one = DistributedError("stream", {1: "FormatError: x.safetensors: cannot read 'w'; check the file"})
    assert one_line("convert", one) == (
        "shardsync convert: x.safetensors: cannot read 'w' (check the file; on worker 1)",
        2,
    )
    mixed = DistributedError("plan", {0: "PlanError: a", 1: "ValueError: b (at x.py:3)"})
    assert one_line("plan", mixed) == (
        "shardsync plan: workers 0, 1 failed in 'plan', e.g. PlanError: a (run with --debug to see each)",
        2,
    )


def test_command_line_runs(ck: Checkpoints) -> None:
    """The real command: exit status and stderr, no traceback, for a user error and a success (each
    case's line is checked in-process above, through the same ``main``; a new interpreter per case cost
    this file most of its time)."""
    for argv, status in (
        (["convert", str(ck.single), str(ck.root / "hf_out")], 2),
        (["diff", str(ck.single), str(ck.dcp)], 0),
    ):
        run = subprocess.run([sys.executable, "-m", "shardsync", *argv], capture_output=True, text=True)
        assert run.returncode == status, run.stderr
        assert "Traceback" not in run.stderr
        assert run.stderr.count("\n") == (status != 0), run.stderr
