"""``save_hf`` without ``config_from`` (or a config.json among ``extra_files``) warns that
``from_pretrained`` will not load the result; with one it does not."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import shardsync


def test_without_a_config_it_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shardsync.io.save_hf"):
        shardsync.save_hf({"w": torch.ones(3)}, tmp_path / "out")
    (record,) = [r for r in caplog.records if "config.json" in r.getMessage()]
    assert "from_pretrained" in record.getMessage() and "config_from=" in record.getMessage()


@pytest.mark.parametrize("how", ["config_from", "extra_files"])
def test_with_a_config_it_does_not(tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    kw = (
        {"config_from": tmp_path / "model"}
        if how == "config_from"
        else {"extra_files": [tmp_path / "model" / "config.json"]}
    )
    with caplog.at_level(logging.WARNING, logger="shardsync.io.save_hf"):
        shardsync.save_hf({"w": torch.ones(3)}, tmp_path / "out", **kw)
    assert not [r for r in caplog.records if "config.json" in r.getMessage()]
    assert (tmp_path / "out" / "config.json").is_file()
