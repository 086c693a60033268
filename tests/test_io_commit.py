"""Crash safety of the safetensors commit: a writer killed (SIGKILL) at every stage leaves exactly the
old or exactly the new checkpoint, never touches other files, and the next save cleans up."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardsync
from crash_helpers import Crasher
from reference import arange_tensor
from shardsync.errors import FormatError
from shardsync.io import commit, save_safetensors
from shardsync.io.commit import CheckpointNames, scan

FOREIGN = {
    "model_ema.safetensors": None,
    "config.json": b'{"model_type": "llama"}\n',
    "model-ema-00001-of-00002.safetensors": None,
}


def load_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """What a reader sees, by transformers' rule (written out here, independently of the writer)."""
    if (d / "model.safetensors").exists():
        return load_file(d / "model.safetensors")
    index = d / "model.safetensors.index.json"
    if not index.exists():
        return {}
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(weight_map.values())):
        part = load_file(d / f)
        assert sorted(part) == sorted(k for k, v in weight_map.items() if v == f)
        out.update(part)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def checkpoint(n: int, start: int) -> dict[str, torch.Tensor]:
    """``n`` tensors of 17 floats (68 bytes); with a limit of 150 bytes, two per file."""
    return {f"layers.{i}.w": arange_tensor((17,), torch.float32, start=start + 100 * i) for i in range(n)}


def foreign_files(d: Path) -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in FOREIGN.items():
        if data is None:
            save_file({"ema": arange_tensor((3,))}, str(d / name))
        else:
            (d / name).write_bytes(data)
    return {name: (d / name).read_bytes() for name in FOREIGN}


def save(new: dict[str, torch.Tensor], d: Path, limit: int, writer: str = "save_safetensors") -> None:
    if writer == "save_hf":
        shardsync.save_hf(new, d, max_file_size=limit, overwrite=True)
    else:
        save_safetensors(list(new.items()), d, max_shard_bytes=limit, overwrite=True)


def save_killed_at(new: dict[str, torch.Tensor], d: Path, limit: int, kill_at: int, writer: str) -> None:
    """Save, SIGKILLing this process right after stage ``kill_at`` (a shard or index file just written
    is first cut to half its size: a crash in the middle of that write). Runs in a crash child."""
    calls = [0]

    def hook(stage: str) -> None:
        if calls[0] == kill_at:
            if stage.startswith("wrote "):
                tmp = d / stage.split(" ", 1)[1]
                os.truncate(tmp, tmp.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1

    commit.stage_hook = hook
    save(new, d, limit, writer)


def stages_of(
    old_dir: Path, tmp: Path, new: dict[str, torch.Tensor], limit: int, writer: str = "save_safetensors"
) -> list[str]:
    work = tmp / "dry"
    shutil.copytree(old_dir, work)
    seen: list[str] = []
    commit.stage_hook = seen.append
    try:
        save(new, work, limit, writer)
    finally:
        commit.stage_hook = None
    shutil.rmtree(work)
    return seen


# (old tensors, old limit, new tensors, new limit): sharded over sharded with the same file names,
# single file -> sharded, sharded -> single file, nothing -> sharded
TRANSITIONS = {
    "sharded-to-sharded": (checkpoint(5, 0), 150, checkpoint(6, 1000), 150),
    "single-to-sharded": (checkpoint(2, 0), 10**6, checkpoint(5, 1000), 150),
    "sharded-to-single": (checkpoint(5, 0), 150, checkpoint(3, 1000), 10**6),
    "empty-to-sharded": ({}, 1, checkpoint(5, 1000), 150),
}
CASES = [(name, "save_safetensors") for name in sorted(TRANSITIONS)] + [("sharded-to-sharded", "save_hf")]


@pytest.mark.parametrize("name, writer", CASES)
def test_killed_at_every_stage_leaves_old_or_new(tmp_path: Path, name: str, writer: str, crasher: Crasher) -> None:
    old, old_limit, new, new_limit = TRANSITIONS[name]
    template = tmp_path / "template"
    foreign = foreign_files(template)
    if old:
        save_safetensors(list(old.items()), template, max_shard_bytes=old_limit)
    stages = stages_of(template, tmp_path, new, new_limit, writer)
    commit_at = stages.index("committed")
    assert stages.count("committed") == 1 and commit_at > 0
    for k in range(len(stages)):
        d = tmp_path / f"kill{k}"
        shutil.copytree(template, d)
        status = crasher.run(save_killed_at, new, d, new_limit, k, writer)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, stages[k]
        assert same(load_checkpoint(d), new if k >= commit_at else old), f"killed after {stages[k]!r}"
        assert {f: (d / f).read_bytes() for f in FOREIGN} == foreign, stages[k]
        save(new, d, new_limit, writer)
        assert same(load_checkpoint(d), new)
        names = {p.name for p in d.iterdir()}
        committed = set(scan(d, CheckpointNames()).committed)
        assert names == committed | set(FOREIGN), f"leftovers after {stages[k]!r}: {names - committed}"
        shutil.rmtree(d)


def test_stages_cover_writes_renames_index_and_removal(tmp_path: Path) -> None:
    old, old_limit, new, new_limit = TRANSITIONS["sharded-to-sharded"]
    save_safetensors(list(old.items()), tmp_path / "old", max_shard_bytes=old_limit)
    stages = stages_of(tmp_path / "old", tmp_path, new, new_limit)
    kinds = [s.split(" ")[0] for s in stages]
    assert kinds == ["wrote"] * 3 + ["renamed"] * 3 + ["wrote", "committed"] + ["removed"] * 3
    assert stages[6].endswith(".index.tmp") and all(s.endswith("-of-00003.safetensors") for s in stages[8:])


def test_new_names_never_collide_with_the_old_checkpoint(tmp_path: Path) -> None:
    save_safetensors(list(checkpoint(5, 0).items()), tmp_path, max_shard_bytes=150)
    plain = sorted(p.name for p in tmp_path.glob("model-*"))
    assert plain == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    res = save_safetensors(list(checkpoint(6, 7).items()), tmp_path, max_shard_bytes=150, overwrite=True)
    tagged = sorted(p.name for p in res.files)
    assert len(tagged) == 3 and not set(tagged) & set(plain)
    assert all(n.startswith(f"model-0000{i}-of-00003-") for i, n in enumerate(tagged, 1))
    save_safetensors(list(checkpoint(6, 9).items()), tmp_path, max_shard_bytes=150, overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("model-*")) == plain  # plain names are free again
    assert same(load_checkpoint(tmp_path), checkpoint(6, 9))


def test_other_files_neither_refuse_nor_get_removed(tmp_path: Path) -> None:
    foreign = foreign_files(tmp_path)
    save_safetensors(list(checkpoint(3, 0).items()), tmp_path, max_shard_bytes=150)  # no refusal
    save_safetensors(list(checkpoint(1, 5).items()), tmp_path, overwrite=True)
    assert {f: (tmp_path / f).read_bytes() for f in FOREIGN} == foreign
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*FOREIGN, "model.safetensors"])
    with pytest.raises(FormatError, match=r"holds a checkpoint \(model.safetensors\).*overwrite=True"):
        save_safetensors(list(checkpoint(1, 0).items()), tmp_path)


def test_leftovers_of_killed_saves_are_removed_without_overwrite(tmp_path: Path) -> None:
    tensors = checkpoint(4, 0)
    save_file(dict(list(tensors.items())[:2]), str(tmp_path / "model-00001-of-00002.safetensors"))
    for name in (
        ".model.0a1b2c3d.00002.tmp",
        ".model.0a1b2c3d.index.tmp",
        ".model-00003.safetensors.tmp77",
        "model.safetensors.index.json.tmp77",
    ):
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / ".model.notes.tmp").write_bytes(b"not ours: no tag")
    assert scan(tmp_path, CheckpointNames()).committed == ()  # shards without an index: no checkpoint
    save_safetensors(list(tensors.items()), tmp_path, max_shard_bytes=150)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".model.notes.tmp",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert same(load_checkpoint(tmp_path), tensors)


def test_scan_follows_the_readers_rule(tmp_path: Path) -> None:
    names = CheckpointNames()
    save_safetensors(list(checkpoint(3, 0).items()), tmp_path, max_shard_bytes=150)
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert scan(tmp_path, names).committed == ("model.safetensors.index.json", *shards)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # it hides the index
    state = scan(tmp_path, names)
    assert state.committed == ("model.safetensors",)
    assert state.leftovers == (*shards, "model.safetensors.index.json")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    assert scan(tmp_path, names).committed == ("model.safetensors.index.json",)  # protected as it is


def test_own_names() -> None:
    names = CheckpointNames()
    own = [
        "model.safetensors",
        "model.safetensors.index.json",
        "model-00002-of-00013.safetensors",
        "model-00002-of-00013-0a1b2c3d.safetensors",
        ".model.0a1b2c3d.00001.tmp",
        ".model.0a1b2c3d.config.json.tmp",
    ]
    other = [
        "model_ema.safetensors",
        "model-ema-00001-of-00002.safetensors",
        "model-1-of-2.safetensors",
        "model-00002-of-00013-NOTATAG.safetensors",
        "config.json",
        ".model.notes.tmp",
        "pytorch_model.bin",
        "model.safetensors.bak",
    ]
    assert [names.is_own(n) for n in own] == [True] * len(own)
    assert [names.is_own(n) for n in other] == [False] * len(other)


def test_output_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("x")
    with pytest.raises(FormatError, match="is a file, not a directory"):
        save_safetensors([("a", torch.zeros(1))], tmp_path / "out")


def test_a_failed_commit_removes_what_it_wrote(tmp_path: Path) -> None:
    old = checkpoint(3, 0)
    save_safetensors(list(old.items()), tmp_path, max_shard_bytes=150)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(stage: str) -> None:
        if stage.startswith("wrote ") and stage.endswith(".index.tmp"):
            raise OSError(28, "No space left on device")

    commit.stage_hook = full_disk
    try:
        with pytest.raises(OSError, match="No space left"):
            save_safetensors(list(checkpoint(4, 9).items()), tmp_path, max_shard_bytes=150, overwrite=True)
    finally:
        commit.stage_hook = None
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
