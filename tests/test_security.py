"""A checkpoint from elsewhere cannot run code (DCP metadata is unpickled with an allow-list), make a
save read or write outside the directories it was given, or send escape codes to the terminal."""

from __future__ import annotations

import json
import os
import pickle
import stat
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import shardsync
from reference import arange_tensor
from shardsync.cli import main
from shardsync.errors import FormatError
from shardsync.sources import DcpSource


class _Command:
    """Unpickles as a call of ``os.system`` (what a crafted ``.metadata`` does)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def _crafted(d: Path, how: str) -> Path:
    """A DCP directory whose ``.metadata`` runs ``touch <d>/ran`` when unpickled."""
    d.mkdir()
    ok = d.parent / f"{d.name}_ok"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=ok, no_dist=True)
    evil = _Command(f"touch {d / 'ran'}")
    if how == "plain":
        payload: object = evil
    else:  # well-formed DCP metadata, with the call hidden in one of its fields
        payload = pickle.loads((ok / ".metadata").read_bytes())
        payload.planner_data = {"w": evil}
    (d / ".metadata").write_bytes(pickle.dumps(payload))
    for f in ok.glob("*.distcp"):
        (d / f.name).write_bytes(f.read_bytes())
    return d


@pytest.mark.parametrize("how", ["plain", "nested"])
def test_crafted_metadata_runs_nothing(tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = _crafted(tmp_path / "evil", how)
    with pytest.raises(FormatError, match=r"names posix\.system, which DCP metadata is not made of"):
        DcpSource(d)
    for argv in (
        ["inspect", str(d)],
        ["convert", str(d), str(tmp_path / "out")],
        ["diff", str(d), str(d)],
        ["plan", str(d)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refusing to load it" in err, err
    assert not (d / "ran").exists()


def test_metadata_of_every_dtype_and_entry_kind_reads(tmp_path: Path) -> None:
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ]
    state: dict[str, object] = {f"t{i}": arange_tensor((17,), torch.float32).to(dt) for i, dt in enumerate(dtypes)}
    state.update({"extra": {"step": 3}, "note": "text", "blob": b"xy"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    src = DcpSource(tmp_path)
    assert sorted(src.tensors) == sorted(f"t{i}" for i in range(len(dtypes)))
    for i, dt in enumerate(dtypes):
        got = src.read(f"t{i}", shardsync.Box((3,), (11,)))
        assert got.dtype == dt and torch.equal(got, state[f"t{i}"][3:14])  # type: ignore[index]


def _model_dir(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"dtype": "float32", "hidden_size": 17}\n')
    return d


def test_config_from_links_out_of_the_directory_are_refused(tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    secret = tmp_path / "secret.txt"
    secret.write_text("a private key\n")
    (src / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    with pytest.raises(FormatError, match=rf"{src}/tokenizer.json is a symbolic link to {secret}, outside {src}"):
        shardsync.save_hf({"w": torch.ones(2)}, out, config_from=src)
    assert not out.exists() or not any(out.iterdir())


def test_config_from_links_within_the_directory_or_hf_cache_are_followed(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--m"
    snapshot = _model_dir(repo / "snapshots" / "0123abc")
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text('{"vocab": 17}\n')
    (snapshot / "tokenizer.json").symlink_to("../../blobs/f00d")  # how huggingface_hub lays it out
    (snapshot / "vocab.txt").write_text("a\nb\n")
    (snapshot / "merges.txt").symlink_to("vocab.txt")
    out = tmp_path / "out"
    shardsync.save_hf({"w": torch.ones(2)}, out, config_from=snapshot)
    assert (out / "tokenizer.json").read_text() == '{"vocab": 17}\n' and not (out / "tokenizer.json").is_symlink()
    assert (out / "merges.txt").read_text() == "a\nb\n"


def test_side_files_keep_their_modes(tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    (src / "tokenizer.json").write_text("{}\n")
    os.chmod(src / "tokenizer.json", 0o600)
    os.chmod(src / "config.json", 0o640)
    out = tmp_path / "out"
    shardsync.save_hf({"w": torch.ones(2)}, out, config_from=src, dtype="bf16")  # config.json rewritten
    assert stat.S_IMODE((out / "tokenizer.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o640
    assert '"dtype": "bfloat16"' in (out / "config.json").read_text()


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    (out / ".metadata.tmp").symlink_to(victim)
    return out, victim


def test_dcp_save_does_not_write_through_a_planted_link(tmp_path: Path) -> None:
    out, victim = _planted(tmp_path)
    state = {"w": arange_tensor((17, 3))}
    shardsync.save(state, out)
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".distcp")) == [".metadata"]
    assert torch.equal(DcpSource(out).read("w", shardsync.Box((0, 0), (17, 3))), state["w"])


def test_convert_to_dcp_does_not_write_through_a_planted_link(tmp_path: Path) -> None:
    out, victim = _planted(tmp_path)
    save_file({"w": arange_tensor((17, 3))}, str(tmp_path / "m.safetensors"))
    assert main(["convert", str(tmp_path / "m.safetensors"), str(out), "--to", "dcp", "-q"]) == 0
    assert victim.read_text() == "precious\n" and not (out / ".metadata.tmp").exists()


NAME = "w\x1b]0;owned\x07\x1b[2J\u202e"
SHOWN = "w\\x1b]0;owned\\x07\\x1b[2J\\u202e"


@pytest.mark.parametrize(
    "argv",
    [["inspect", "{f}"], ["plan", "{f}"], ["explain", "{f}"], ["diff", "{f}", "{g}"], ["inspect", "{f}", "--json"]],
)
def test_tensor_names_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    f, g = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({NAME: torch.zeros(3)}, str(f))
    save_file({NAME: torch.ones(3)}, str(g))
    assert load_file(str(f)).keys() == {NAME}
    main([a.format(f=f, g=g) for a in argv])
    out, err = capsys.readouterr()
    if "--json" in argv:
        assert list(json.loads(out)["tensors"]) == [NAME]  # JSON escapes it, and keeps the name exact
    else:
        assert SHOWN in out + err
    assert not any(c in out + err for c in "\x1b\x07\u202e")
