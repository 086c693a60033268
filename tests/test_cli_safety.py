"""The command line never loses a file, never runs code from a checkpoint, never prints a name raw,
and ends every failure (corrupt input, full disk, Ctrl-C) with one line and the right exit status."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import shardsync
from cli_checkpoints import Checkpoints, build
from reference import arange_tensor
from shardsync.cli import main
from shardsync.io import save_safetensors
from shardsync.layout import shard_dim
from shardsync.sources import read_tensors
from shardsync.sources.dcp_metadata import read_metadata


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build(tmp_path_factory.mktemp("ckpts"))


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return status, err.strip()


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "{single}", ""],
        ["convert", "", "out"],
        ["inspect", ""],
        ["diff", "{single}", ""],
        ["plan", ""],
        ["explain", ""],
        ["convert", "{single}", "out", "--config-from", ""],
    ],
)
def test_empty_paths_are_refused(
    ck: Checkpoints,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    save_safetensors([("w", torch.ones(2))], tmp_path, max_shard_bytes=4)  # a checkpoint right here
    before = snapshot(tmp_path)
    status, line = one_line(capsys, [a.format(single=ck.single) for a in argv])
    assert status == 2 and "an empty path names the working directory; give the path" in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fmt", ["single", "sharded", "dcp"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_convert_into_its_own_source_directory_is_refused(
    ck: Checkpoints, tmp_path: Path, fmt: str, overwrite: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ck.all[fmt], src)
    before = snapshot(src)
    for to in ("hf", "dcp"):
        argv = ["convert", str(src), str(src / "."), "--to", to] + ["--overwrite"] * overwrite
        status, line = one_line(capsys, argv)
        assert status == 2 and "the output would replace the files being read (write to another directory)" in line
    assert snapshot(src) == before


def test_convert_keeps_an_index_less_set(ck: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = {f"w{i}": arange_tensor((17,), start=100 * i) for i in range(5)}
    out = tmp_path / "out"
    shardsync.save_hf(old, out, max_file_size=150)
    (out / "model.safetensors.index.json").unlink()
    before = snapshot(out)
    status, line = one_line(capsys, ["convert", str(ck.single), str(out)])
    assert status == 2 and "already holds a checkpoint (model-00001-of-00003.safetensors)" in line
    assert snapshot(out) == before
    assert main(["convert", str(ck.single), str(out), "--overwrite", "-q"]) == 0
    assert sorted(read_tensors(out)) == sorted(read_tensors(ck.single))


# -- a full disk, Ctrl-C ----------------------------------------------------------------------------


def _mounted(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs at ``where`` (the test is skipped where mounting one is not allowed)."""
    where.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A file system of 256 KiB."""
    yield from _mounted(tmp_path / "tiny", "size=256k")


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _mounted(tmp_path / "ro", "ro,size=256k")


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_read_only_disk_is_one_line(
    ck: Checkpoints, read_only_disk: Path, to: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, line = one_line(capsys, ["convert", str(ck.single), str(read_only_disk), "--to", to])
    assert status == 2 and "read-only file system" in line, line
    assert list(read_only_disk.iterdir()) == []


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, tiny_disk: Path, to: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": arange_tensor((127, 129)) for i in range(6)}, str(src))  # 393 KB
    status, line = one_line(capsys, ["convert", str(src), str(tiny_disk / "out"), "--to", to])
    assert status == 2 and line.startswith("shardsync convert: no space left on the device of "), line
    assert line.endswith("(free some space, or write to another directory)")
    assert not (tiny_disk / "out").exists()  # the directory the failed convert created is gone too


def _command(*argv: str) -> subprocess.Popen[str]:
    """``python -m shardsync ...`` with SIGINT as a terminal delivers it (a test runner may ignore it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardsync", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupted(proc: subprocess.Popen[str], command: str) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and err == f"shardsync{command}: interrupted\n", (proc.returncode, err)


def _importing_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return "libtorch" in fh.read()
    except OSError:
        return False


def test_ctrl_c_while_starting(tmp_path: Path) -> None:
    proc = _command("inspect", str(tmp_path))
    deadline = time.monotonic() + 120
    # interrupt once torch's libraries are mapped: the import of torch has begun (and takes a second
    # more), shardsync's guard is in place, and the command has not run yet
    while not _importing_torch(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)
    _interrupted(proc, "")


def _big_source(tmp_path: Path) -> Path:
    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.zeros(2**22) for i in range(48)}, str(src))  # 805 MB of zeros
    return src


def _interrupt_when(proc: subprocess.Popen[str], out: Path, pattern: str) -> None:
    deadline = time.monotonic() + 300
    while not (out.is_dir() and any(out.rglob(pattern))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)


@pytest.mark.parametrize("argv, pattern", [(["--to", "dcp"], "*.distcp"), (["--max-shard-size", "20MB"], "*.tmp")])
def test_ctrl_c_while_writing_leaves_nothing(tmp_path: Path, argv: list[str], pattern: str) -> None:
    out = tmp_path / "out"
    proc = _command("convert", str(_big_source(tmp_path)), str(out), *argv)
    _interrupt_when(proc, out, pattern)
    _interrupted(proc, " convert")
    assert not out.exists()  # nothing partial, and not the directory the convert created


# -- corrupt inputs ---------------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def _dcp_variant(root: Path, name: str, damage: Callable[[Path, list[Path]], None]) -> Path:
    d = root / name
    state = {"w": arange_tensor((17, 5)), "v": arange_tensor((7,))}
    shardsync.save({k: [shard_dim(t, 0, r, 2) for r in range(2)] for k, t in state.items()}, d)
    damage(d, sorted(d.glob("*.distcp")))
    return d


def _edit_metadata(edit: Callable[[Any], None]) -> Callable[[Path, list[Path]], None]:
    def damage(d: Path, _: list[Path]) -> None:
        metadata = read_metadata(d / ".metadata")
        edit(metadata)
        (d / ".metadata").write_bytes(pickle.dumps(metadata))

    return damage


def _drop_chunk(md: Any) -> None:
    del md.storage_data[next(iter(md.storage_data))]


def _offset_past_end(md: Any) -> None:
    next(iter(md.storage_data.values())).offset = 10**9


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("corrupt")
    _dcp_variant(r, "truncated", lambda d, files: os.truncate(files[0], files[0].stat().st_size // 2))
    _dcp_variant(r, "zeroed", lambda d, files: files[0].write_bytes(bytes(files[0].stat().st_size)))
    _dcp_variant(r, "missing_chunk", _edit_metadata(_drop_chunk))
    _dcp_variant(r, "past_end", _edit_metadata(_offset_past_end))
    _dcp_variant(r, "missing_file", lambda d, files: files[0].unlink())
    shardsync.save_hf({"w": arange_tensor((17,)), "v": arange_tensor((7,))}, r / "deep_index", max_file_size=40)
    (r / "deep_index/model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    (r / "deep.json").write_text('{"aoa_statements": ' + DEEP + "}")
    (r / "deep.yaml").write_text("aoa_statements: " + DEEP + "\n")
    (r / "layout_deep.json").write_text(DEEP)
    (r / "layout_negative.json").write_text(
        '{"world_size": 1, "tensors": {"v": {"shape": [-7], "dtype": "float32", "shards": [[0, [0], [-7]]]}}}'
    )
    for name, config in (("cfg_deep", DEEP), ("cfg_list", "[1, 2]"), ("cfg_str", '"x"')):
        shardsync.save_hf({"w": arange_tensor((17,))}, r / name)
        (r / name / "config.json").write_text(config)
    shardsync.save_hf({"w": arange_tensor((17,)), "v": arange_tensor((7,))}, r / "out_list", max_file_size=40)
    (r / "out_list/model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    shardsync.save_hf({"w": arange_tensor((17,))}, r / "src")
    return r


CORRUPT = {
    "convert {r}/truncated {o}": "_0_0.distcp run past its end",
    "inspect {r}/truncated": "incomplete or corrupt DCP checkpoint: 'w' chunk at [0, 0]: bytes",
    "convert {r}/zeroed {o}": "cannot read 'v' from __",
    "convert {r}/missing_chunk {o}": "'v' chunk at [0] is in no data file (the storage data does not place it)",
    "convert {r}/past_end {o}": "'v' chunk at [0]: bytes 1000000000..",
    "convert {r}/missing_file {o}": "_0_0.distcp is missing",
    "inspect {r}/deep_index": "not a safetensors index",
    "convert {r}/src {o} -m {r}/deep.json": "deep.json: invalid JSON: nested too deeply to read",
    "convert {r}/src {o} -m {r}/deep.yaml": "deep.yaml: invalid YAML: nested too deeply to read",
    "explain {r}/layout_deep.json": "is not a layout JSON",
    "explain {r}/layout_negative.json": "box with negative offset or size",
    "convert {r}/cfg_deep {o}": "cfg_deep/config.json is not a JSON object (fix --config-from)",
    "convert {r}/cfg_list {o} --dtype bf16": "cfg_list/config.json is not a JSON object (fix --config-from)",
    "convert {r}/cfg_str {o} -m megatron-llama": "cfg_str/config.json' holds a JSON str, not an object",
    "convert {r}/cfg_deep {o} -m megatron-llama": "invalid JSON: nested too deeply to read",
    "convert {r}/src {r}/out_list": "already holds a checkpoint (model.safetensors.index.json)",
}


@pytest.mark.parametrize("argv, expected", CORRUPT.items())
def test_corrupt_inputs_are_user_errors(
    corrupt: Path, tmp_path: Path, argv: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, line = one_line(capsys, argv.format(r=corrupt, o=tmp_path / "out").split())
    assert status == 2 and expected in line, line


def _workers_of(launcher: int) -> list[int]:
    """The worker processes a ``--nproc`` launcher started (its children, but for the resource tracker
    that multiprocessing starts with spawned workers)."""
    found = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _started(worker: int) -> str:
    """How a worker was started: a spawned one runs multiprocessing's spawn main, a forked one the
    command line of the command that forked it."""
    return "spawn" if b"multiprocessing.spawn" in Path(f"/proc/{worker}/cmdline").read_bytes() else "fork"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize(
    "start, how",
    [
        ("fork", "ctrl-c"),
        ("fork", "worker killed"),
        ("fork", "worker terminated"),  # the handler it inherited from the launcher is reset: it dies
        ("spawn", "ctrl-c"),
        ("spawn", "worker killed"),
    ],
)
def test_nproc_interrupted_or_worker_dead_is_one_line(tmp_path: Path, start: str, how: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardsync",
            "convert",
            str(_big_source(tmp_path)),
            str(out),
            "--nproc",
            "2",
            "--max-shard-size",
            "20MB",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SHARDSYNC_START_METHOD": "spawn" if start == "spawn" else ""},
        preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL), os.setpgrp()),
    )
    try:
        deadline = time.monotonic() + 300
        while not (out.is_dir() and any(out.rglob("*.tmp"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.001)
        workers = _workers_of(proc.pid)
        assert len(workers) == 2 and {_started(w) for w in workers} == {start}
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: to the launcher and its workers
        else:
            os.kill(max(workers), signal.SIGKILL if how == "worker killed" else signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # a failed check leaves no process behind
        raise
    assert not [w for w in workers if _running(w)]  # the command ended its workers before it exited
    if how == "ctrl-c":
        assert (proc.returncode, err) == (130, "shardsync convert: interrupted\n")
    else:
        assert proc.returncode == 2 and err.count("\n") == 1, err
        code = -9 if how == "worker killed" else -15
        assert err.startswith("shardsync convert: worker ") and f"died with exit code {code} " in err, err
    assert not out.exists()  # nothing partial, and not the directory the convert created


def test_ctrl_c_that_surfaces_as_another_error_is_still_an_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shardsync.cli as cli

    def inspect_hit_by_ctrl_c(args: object) -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # lands inside a library call...
            time.sleep(5)
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'UntypedStorage'")  # noqa: B904 (turns it)
        return 0

    monkeypatch.setitem(cli._COMMANDS, "inspect", inspect_hit_by_ctrl_c)
    assert cli.main(["inspect", "x"]) == 130
    assert capsys.readouterr().err == "shardsync inspect: interrupted\n"
