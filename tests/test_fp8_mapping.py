"""Block FP8 through mappings (tier 1 and files): without a dtype a weight and its scales are one
tensor (renames carry the scales, block-aligned splits and concatenations cut the scale grid with
them, a cut through a block is refused); quantising through a mapping that renames goes by target name.

Weights have odd shapes with partial edge blocks, codes come from an arange with a fractional step and
every block has its own scale, so a misplaced block, row or scale shows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardsync
from reference import arange_tensor
from shardsync import full_params, load, read_tensors, save_hf
from shardsync.cli import main
from shardsync.errors import MappingError
from shardsync.mapping import resolve
from shardsync.quant import dequantize
from shardsync.sources import Fp8Source
from test_fp8 import E4M3, codes, reference, scales

BLOCK = (64, 32)


def checkpoint(d: Path, weights: dict[str, tuple[int, int]], block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """Block-FP8 ``weights`` (name: shape) and an fp32 norm in ``d``, with config.json naming ``block``."""
    tensors = {"norm.weight": arange_tensor((17,), step=0.1)}
    for k, (name, shape) in enumerate(weights.items()):
        tensors[name], tensors[name + "_scale_inv"] = codes(shape, start=3 * k), scales(shape, block)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (d / "config.json").write_text(json.dumps({"quantization_config": q}))
    return tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- no dtype: the scales follow their weight ------------------------------------------------------------


def test_a_rename_carries_the_scales(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    held = checkpoint(tmp_path / "src", {"a.weight": (300, 17)})
    with caplog.at_level(logging.WARNING):
        save_hf(tmp_path / "src", tmp_path / "out", ["a.weight -> b.weight", "norm.weight -> norm.weight"])
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == ["b.weight", "b.weight_scale_inv", "norm.weight"]
    assert same(got["b.weight"], held["a.weight"]) and same(got["b.weight_scale_inv"], held["a.weight_scale_inv"])
    assert "unconsumed" not in caplog.text  # the scales are no source of their own


def test_splits_at_block_boundaries_split_the_scales(tmp_path: Path) -> None:
    # rows 256 = 2 x 128 (blocks of 64 rows), columns 17 (one partial block); columns 64 = 2 x 32, rows 129
    held = checkpoint(tmp_path, {"w": (256, 17), "u": (129, 64)})
    got = dict(full_params(tmp_path, ["w -> top, bot, axis=0", "u -> left, right, axis=1", "norm.weight -> n"]))
    assert sorted(got) == [
        "bot",
        "bot_scale_inv",
        "left",
        "left_scale_inv",
        "n",
        "right",
        "right_scale_inv",
        "top",
        "top_scale_inv",
    ]
    parts = {
        "top": ("w", slice(0, 128), slice(None)),
        "bot": ("w", slice(128, 256), slice(None)),
        "left": ("u", slice(None), slice(0, 32)),
        "right": ("u", slice(None), slice(32, 64)),
    }
    for name, (src, rows, cols) in parts.items():
        assert same(got[name], held[src][rows, cols]), name
        values = reference(held[src], held[src + "_scale_inv"], BLOCK)[rows, cols]
        assert torch.equal(reference(got[name], got[name + "_scale_inv"], BLOCK), values), name
    assert same(got["top_scale_inv"], held["w_scale_inv"][:2]) and same(got["bot_scale_inv"], held["w_scale_inv"][2:])
    assert same(got["right_scale_inv"], held["u_scale_inv"][:, 1:])


def test_a_concatenation_joins_the_scales_and_round_trips(tmp_path: Path) -> None:
    held = checkpoint(tmp_path / "src", {"w": (256, 17)})
    save_hf(tmp_path / "src", tmp_path / "split", ["w -> top, bot, axis=0", "norm.weight -> norm.weight"])
    assert sorted(load_file(str(tmp_path / "split" / "model.safetensors"))) == [
        "bot",
        "bot_scale_inv",
        "norm.weight",
        "top",
        "top_scale_inv",
    ]
    (tmp_path / "split" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    save_hf(tmp_path / "split", tmp_path / "joined", ["top, bot -> w, axis=0", "norm.weight -> norm.weight"])
    got = load_file(str(tmp_path / "joined" / "model.safetensors"))
    assert sorted(got) == ["norm.weight", "w", "w_scale_inv"]
    assert same(got["w"], held["w"]) and same(got["w_scale_inv"], held["w_scale_inv"])


@pytest.mark.parametrize(
    "statement, says",
    [
        (
            "w -> top, bot, axis=0",
            r"'bot': w\[150:300, 0:17\] -> \[0:150, 0:17\] cuts blocks of \[64, 32\] "
            r"\(rows 150\.\.300 land at 0\.\.150\)",
        ),
        ("w^T -> t", r"'t': moves the rows and columns of 'w' \(a transpose"),
    ],
)
def test_a_cut_through_a_block_without_a_dtype_asks_for_one(tmp_path: Path, statement: str, says: str) -> None:
    held = checkpoint(tmp_path / "src", {"w": (300, 17)})
    with pytest.raises(MappingError, match=says) as caught:
        save_hf(tmp_path / "src", tmp_path / "out", [statement, "norm.weight -> n"])
    assert "ask for a dtype to dequantise them" in str(caught.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # with a dtype the weights are values: the cut is exact
    save_hf(tmp_path / "src", tmp_path / "out", [statement, "norm.weight -> n"], dtype="bf16")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    values = reference(held["w"], held["w_scale_inv"], BLOCK).to(torch.bfloat16)
    want = values[150:] if "bot" in statement else values.T
    assert "bot_scale_inv" not in got and torch.equal(got["bot" if "bot" in statement else "t"], want)


def test_the_block_of_a_cut_is_the_sources_config(tmp_path: Path) -> None:
    # rows 256 in two: aligned to blocks of 64 (the config's) and of 128, but the scale grid of 4 rows
    # fits only the config's block; a checkpoint without config.json is read as 128 x 128 and refused
    checkpoint(tmp_path, {"w": (256, 17)})
    (tmp_path / "config.json").unlink()
    with pytest.raises(
        MappingError,
        match=r"scales 'w_scale_inv' of shape \[4, 1\] do not fit weight 'w' of "
        r"shape \[256, 17\] in blocks of \[128, 128\]",
    ):
        dict(full_params(tmp_path, ["w -> top, bot, axis=0"]))
    assert sorted(dict(full_params(Fp8Source(tmp_path, block=BLOCK), ["w -> top, bot, axis=0"]))) == [
        "bot",
        "norm.weight",
        "top",
    ]  # read as values, the block given


def test_a_program_that_maps_the_scales_itself_is_followed(tmp_path: Path) -> None:
    held = checkpoint(tmp_path, {"w": (300, 17)})
    got = dict(full_params(tmp_path, ["w -> v", "w_scale_inv -> s", "norm.weight -> n"]))
    assert sorted(got) == ["n", "s", "v"] and same(got["s"], held["w_scale_inv"])


def test_resolve_joins_no_fp8_weight_with_other_tensors() -> None:
    from shardsync.layout import GlobalLayout
    from shardsync.layout.box import Box

    lay = GlobalLayout.merge(
        [
            [
                ("w", (128, 4), "float8_e4m3fn", Box((0, 0), (128, 4))),
                ("w_scale_inv", (1, 1), "float32", Box((0, 0), (1, 1))),
                ("x", (128, 4), "float8_e4m3fn", Box((0, 0), (128, 4))),
            ]
        ]
    )
    with pytest.raises(MappingError, match=r"'c': joins block-FP8 weights with tensors that have no scales \('x'\)"):
        resolve(["w, x -> c, axis=0"], lay)


def test_load_an_fp8_checkpoint_through_a_rename_into_fp8_shards(tmp_path: Path) -> None:
    held = checkpoint(tmp_path, {"w": (300, 17)}, block=(128, 128))
    dest = {"v": torch.zeros(300, 17, dtype=E4M3), "v_scale_inv": torch.zeros(3, 1), "n": torch.zeros(17)}
    load(dest, tmp_path, ["w -> v", "norm.weight -> n"])
    assert same(dest["v"], held["w"]) and same(dest["v_scale_inv"], held["w_scale_inv"])


def test_load_through_a_split_uses_the_checkpoints_block(tmp_path: Path) -> None:
    # as full_params does: blocks of 64 rows (config.json), so the scale rows are 0-1 | 2-3
    held = checkpoint(tmp_path, {"w": (256, 17)})
    program = ["w -> top, bot, axis=0", "norm.weight -> n"]
    dest = {
        "top": torch.zeros(128, 17, dtype=E4M3),
        "top_scale_inv": torch.zeros(2, 1),
        "bot": torch.zeros(128, 17, dtype=E4M3),
        "bot_scale_inv": torch.zeros(2, 1),
        "n": torch.zeros(17),
    }
    load(dest, tmp_path, program)
    assert same(dest["top"], held["w"][:128]) and same(dest["bot"], held["w"][128:])
    assert same(dest["top_scale_inv"], held["w_scale_inv"][:2]) and same(dest["bot_scale_inv"], held["w_scale_inv"][2:])


# -- quantising through a mapping that renames -----------------------------------------------------------


def test_save_hf_quantises_renamed_targets_by_their_names(tmp_path: Path) -> None:
    state = {
        "layers.0.fc1": arange_tensor((300, 17), step=0.0137, start=-30),
        "layers.0.fc2": arange_tensor((129, 257), step=-0.003, start=40),
        "ln": torch.ones(17),
    }
    program = [
        "layers.0.fc1 -> model.layers.0.mlp.up_proj.weight",
        "layers.0.fc2 -> model.layers.0.mlp.down_proj.weight",
        "ln -> model.norm.weight",
    ]
    save_hf(state, tmp_path / "default", program, quantize="fp8", quantize_block=BLOCK)
    save_hf(
        state,
        tmp_path / "chosen",
        program,
        quantize="fp8",
        quantize_block=BLOCK,
        quantize_patterns=[r"down_proj", r"fc1"],
    )  # fc1 is a source name: it selects nothing
    default, chosen = read_tensors(tmp_path / "default"), read_tensors(tmp_path / "chosen")
    assert {k: str(v.dtype) for k, v in default.items()} == {
        "model.layers.0.mlp.down_proj.weight": "torch.float8_e4m3fn",
        "model.layers.0.mlp.down_proj.weight_scale_inv": "torch.float32",
        "model.layers.0.mlp.up_proj.weight": "torch.float8_e4m3fn",
        "model.layers.0.mlp.up_proj.weight_scale_inv": "torch.float32",
        "model.norm.weight": "torch.float32",
    }
    assert sorted(k for k, v in chosen.items() if v.dtype == E4M3) == ["model.layers.0.mlp.down_proj.weight"]
    back = dict(full_params(Fp8Source(tmp_path / "default", block=BLOCK)))
    for source, name in (
        ("layers.0.fc1", "model.layers.0.mlp.up_proj.weight"),
        ("layers.0.fc2", "model.layers.0.mlp.down_proj.weight"),
    ):
        q, s = default[name], default[name + "_scale_inv"]
        assert torch.equal(back[name], dequantize(q, s, BLOCK))
        grid = s.repeat_interleave(BLOCK[0], 0)[: q.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : q.shape[1]]
        w = state[source]
        assert bool(((back[name] - w).abs() <= w.abs() / 16 + grid / 1024).all()), name


def test_convert_quantize_through_a_renaming_mapping(tmp_path: Path) -> None:
    w = arange_tensor((300, 17), step=0.0137, start=-30)
    (tmp_path / "src").mkdir()
    save_file({"fc.weight": w, "ln.weight": torch.ones(17)}, str(tmp_path / "src" / "model.safetensors"))
    mapping = tmp_path / "m.txt"
    mapping.write_text("fc.weight -> model.up_proj.weight\nln.weight -> model.norm.weight\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "convert",
                str(tmp_path / "src"),
                str(out),
                "--mapping",
                str(mapping),
                "--quantize",
                "fp8",
                "--quantize-block",
                "64,32",
                "--quiet",
            ]
        )
        == 0
    )
    got = read_tensors(out)
    assert sorted(got) == ["model.norm.weight", "model.up_proj.weight", "model.up_proj.weight_scale_inv"]
    back = dict(full_params(Fp8Source(out, block=BLOCK), ["model.up_proj.weight -> up"]))
    q, s = got["model.up_proj.weight"], got["model.up_proj.weight_scale_inv"]
    assert torch.equal(back["up"], dequantize(q, s, BLOCK)) and bool(
        ((back["up"] - w).abs() <= w.abs() / 16 + s.max() / 1024).all()
    )


def test_digest_under_a_cutting_mapping_uses_the_checkpoints_block(tmp_path: Path) -> None:
    held = checkpoint(tmp_path, {"w": (256, 17)})  # blocks of 64 rows: scale rows 0-1 | 2-3
    got = shardsync.digest(tmp_path, ["w -> top, bot, axis=0", "norm.weight -> n"])
    assert got["bot_scale_inv"] == shardsync.tensor_digest(held["w_scale_inv"][2:])
    assert got["top"] == shardsync.tensor_digest(held["w"][:128])
