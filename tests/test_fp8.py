"""Block FP8 both ways (tier 1 and files): dequantising per box, quantising, ``convert`` and ``save_hf``.

The reference dequantisation is a loop over blocks, ``q[block].float() * scale[i, j]``; codes are
filled from an arange with a fractional step and every block has its own scale, so a misplaced block,
row or scale shows. Shapes are odd (300 x 17, 129 x 257) so that the edge blocks are partial.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference import arange_tensor
from shardsync import full_params, load, plan, save_hf
from shardsync.cli import main
from shardsync.errors import LayoutError, PlanError
from shardsync.layout import Box, LocalShard
from shardsync.quant import dequantize, quantize, scale_shape
from shardsync.sources import Fp8Source, LocalSource
from shardsync.sources.fp8_quantized import QuantizedSource

E4M3 = torch.float8_e4m3fn
SHAPES = {"layers.0.mlp.up_proj.weight": (300, 17), "layers.0.self_attn.o_proj.weight": (129, 257)}


def codes(shape: tuple[int, ...], start: int = 0) -> torch.Tensor:
    """e4m3 codes, all different over a stretch: -200 .. 200 in steps of 0.37 (rounded by e4m3)."""
    return (torch.remainder(arange_tensor(shape, step=0.37, start=start), 400.0) - 200.0).to(E4M3)


def scales(shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    return arange_tensor(scale_shape(shape, block), step=0.013, start=1) / 7


def reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The dequantisation, block by block."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[..., rows, cols] = q[..., rows, cols].to(torch.float32) * s[..., i : i + 1, j : j + 1]
    return out


def fp8_checkpoint(d: Path, block: tuple[int, int] = (128, 128), config: bool = True) -> dict[str, torch.Tensor]:
    """A DeepSeek-style checkpoint in ``d``: FP8 Linear weights with scales, fp32 norm, bf16 embedding.
    Returns what it holds."""
    tensors: dict[str, torch.Tensor] = {
        "layers.0.norm.weight": arange_tensor((17,), step=0.1),
        "embed_tokens.weight": arange_tensor((7, 17), torch.bfloat16),
    }
    for k, (name, shape) in enumerate(SHAPES.items()):
        tensors[name] = codes(shape, start=k)
        tensors[name + "_scale_inv"] = scales(shape, block)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    if config:
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        (d / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization_config": q}))
    return tensors


# -- the block grid -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, block", [((300, 17), (128, 128)), ((129, 257), (128, 128)), ((17, 33), (16, 8)), ((3, 20, 9), (8, 4))]
)
def test_dequantize_is_the_blockwise_product(shape: tuple[int, ...], block: tuple[int, int]) -> None:
    q, s = codes(shape), scales(shape, block)
    assert torch.equal(dequantize(q, s, block), reference(q, s, block))


def test_a_box_reads_the_scales_of_the_blocks_it_cuts() -> None:
    block = (16, 8)
    q, s = codes((45, 29)), scales((45, 29), block)
    src = Fp8Source({"w": q, "w_scale_inv": s}, block=block)
    full = reference(q, s, block)
    assert [(e.key, e.dtype, e.shape) for e in src.entries()] == [("w", "float32", (45, 29))]
    for offsets, sizes in [
        ((0, 0), (45, 29)),
        ((7, 3), (20, 11)),
        ((15, 7), (2, 2)),
        ((33, 24), (12, 5)),
        ((16, 8), (16, 8)),
        ((44, 28), (1, 1)),
        ((3, 0), (0, 4)),
    ]:
        box = Box(offsets, sizes)
        assert torch.equal(src.read("w", box), full[box.slices()]), box


def test_the_block_comes_from_config_json(tmp_path: Path) -> None:
    held = fp8_checkpoint(tmp_path, block=(64, 32))
    name = "layers.0.mlp.up_proj.weight"
    got = dict(full_params(Fp8Source(tmp_path)))
    assert torch.equal(got[name], reference(held[name], held[name + "_scale_inv"], (64, 32)))
    assert sorted(got) == sorted(k for k in held if not k.endswith("_scale_inv"))


def test_dequantisation_agrees_with_transformers() -> None:
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    q, s = codes((300, 17)), scales((300, 17), (128, 128))
    theirs = fp8._dequantize_fp8_weight(q, s, [128, 128], torch.float32)
    assert torch.equal(dequantize(q, s, (128, 128)), theirs)


# -- quantising ---------------------------------------------------------------------------------------


def test_quantize_within_e4m3_precision_and_amax_to_448() -> None:
    block = (128, 128)
    w = arange_tensor((300, 17), step=0.0137, start=-30)
    w[128:256, :] = 0  # an all-zero block row
    q, s = quantize(w, block)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (3, 1)
    back = dequantize(q, s, block)
    assert not back.isnan().any() and torch.equal(back[128:256], torch.zeros(128, 17))
    assert s[1, 0] == 1.0  # a zero block's scale: codes 0, nothing divided by 0
    for i in (0, 2):
        part = w[i * 128 : (i + 1) * 128]
        assert s[i, 0] == part.abs().max() / 448
        assert q[i * 128 : (i + 1) * 128].float().abs().max() == 448  # the block's amax is the top code
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (subnormal), 2^-10 absolute
    bound = torch.maximum(w.abs() * 2**-4, s.repeat_interleave(128, 0)[:300] * 2**-10)
    assert ((back - w).abs() <= bound).all()


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_scales_are_the_correctly_rounded_quotient_on_every_device(device: str) -> None:
    # CUDA divides by a Python number as a multiply by its reciprocal: an ulp off now and then. The host
    # divides correctly either way, so this guards on a CUDA machine only (make gpu-check runs it there)
    w = (arange_tensor((640, 640), step=0.00731, start=-1500) * 1.37).sin() * 1000
    q, s = quantize(w.to(device), (8, 8))
    amax = w.unflatten(1, (80, 8)).unflatten(0, (80, 8)).abs().amax(dim=(1, 3))
    assert torch.equal(s.cpu(), (amax.double() / 448).float())
    assert torch.equal(q.cpu().view(torch.uint8), quantize(w, (8, 8))[0].view(torch.uint8))


def test_full_params_yields_each_weight_then_its_scales() -> None:
    state = {
        "model.layers.0.mlp.down_proj.weight": arange_tensor((17, 130), step=0.01),
        "model.layers.0.mlp.gate.weight": arange_tensor((4, 17)),
        "model.norm.weight": torch.ones(17),
        "lm_head.weight": arange_tensor((5, 17)),
        "model.embed_tokens.weight": arange_tensor((5, 17)),
    }
    got = list(full_params(state, quantize="fp8", quantize_block=(16, 64)))
    names = [n for n, _ in got]
    assert names == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale_inv",
        "model.layers.0.mlp.gate.weight",
        "model.norm.weight",
    ]
    out = dict(got)
    q, s = quantize(state["model.layers.0.mlp.down_proj.weight"], (16, 64))
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"].float(), q.float())
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight_scale_inv"], s) and s.shape == (2, 3)
    for name in ("lm_head.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight"):
        assert torch.equal(out[name], state[name])
    only = [n for n, _ in full_params(state, quantize="fp8", quantize_patterns=[r"gate\.weight$"])]
    assert only.count("model.layers.0.mlp.gate.weight_scale_inv") == 1 and len(only) == 6


def test_plan_takes_the_quantize_options_of_full_params() -> None:
    state = {"a.weight": torch.zeros(3, 4)}
    assert plan(state, quantize="fp8", quantize_block=(2, 2)).order == ("a.weight",)
    with pytest.raises(PlanError, match="quantize_block"):
        plan(state, quantize="fp8", quantize_block=(2,))


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"quantize": "int4"}, "'fp8'"),
        ({"quantize": "fp8", "quantize_block": (0, 128)}, "quantize_block"),
        ({"quantize": "fp8", "quantize_patterns": ["("]}, "regular expression"),
    ],
)
def test_bad_quantize_options_raise_at_the_call(kwargs: dict, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        full_params({"w": torch.zeros(2, 2)}, **kwargs)


# -- never silent -------------------------------------------------------------------------------------


def test_fp8_without_scales_cast_to_another_dtype_is_an_error(tmp_path: Path) -> None:
    save_file({"w": codes((5, 3)), "b": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LayoutError, match=r"'w': float8_e4m3fn without scales"):
        save_hf(tmp_path, tmp_path / "out", dtype="bf16")
    with pytest.raises(LayoutError, match=r"FP8 codes cast to another dtype without their scales: 'w'"):
        list(full_params(tmp_path, "w -> w, dtype='bf16'\nb -> b"))
    with pytest.raises(LayoutError, match=r"'w' \(float8_e4m3fn -> float32\)"):
        load({"w": torch.zeros(5, 3), "b": torch.zeros(3)}, tmp_path)
    dest = {"w": torch.zeros(5, 3, dtype=E4M3), "b": torch.zeros(3)}
    load(dest, tmp_path)  # into FP8: as it is
    assert torch.equal(dest["w"].view(torch.uint8), codes((5, 3)).view(torch.uint8))
    save_hf(tmp_path, tmp_path / "out", dtype="bf16", cast_unscaled_fp8=True)  # cast anyway, asked for
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], codes((5, 3)).to(torch.bfloat16))


def test_scales_that_do_not_fit_their_weight_name_it(tmp_path: Path) -> None:
    save_file({"w": codes((300, 17)), "w_scale_inv": torch.ones(2, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        LayoutError,
        match=r"'w_scale_inv': float32 scales of shape \[2, 1\] do not fit weight "
        r"'w' of shape \[300, 17\] in blocks of \[128, 128\]: want float32 "
        r"of shape \[3, 1\]",
    ):
        save_hf(tmp_path, tmp_path / "out", dtype="bf16")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_scales_without_their_weight_are_an_error() -> None:
    with pytest.raises(LayoutError, match=r"'v_scale_inv': scales, but there is no weight 'v'"):
        Fp8Source({"v_scale_inv": torch.ones(1, 1)}).entries()


def test_quantising_a_shard_that_cuts_blocks_names_it() -> None:
    shard = LocalShard(torch.ones(64, 17), (300, 17), (64, 0))
    with pytest.raises(LayoutError, match=r"'w'.*cuts blocks of \[128, 128\]"):
        QuantizedSource(LocalSource({"w": shard}), {"w"}).entries()


def test_load_values_into_fp8_and_scales(tmp_path: Path) -> None:
    w = arange_tensor((300, 17), step=0.0137, start=-30)
    save_file({"w": w, "b": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    dest = {"w": torch.zeros(300, 17, dtype=E4M3), "w_scale_inv": torch.zeros(3, 1), "b": torch.zeros(3)}
    load(dest, tmp_path)
    q, s = quantize(w, (128, 128))
    assert torch.equal(dest["w"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(dest["w_scale_inv"], s)
    renamed = {"v": torch.zeros(300, 17, dtype=E4M3), "v_scale_inv": torch.zeros(3, 1), "b": torch.zeros(3)}
    with pytest.raises(LayoutError, match=r"without quantising: 'v' from 'w' \(float32\)"):
        load(renamed, tmp_path, ["w -> v", "_ -> v_scale_inv", "b -> b"])
    assert not renamed["v"].float().any()  # refused before anything was written


# -- convert and save_hf: acceptance ------------------------------------------------------------------


def test_convert_dtype_bf16_is_the_fp32_dequantisation_bit_for_bit(tmp_path: Path) -> None:
    held = fp8_checkpoint(tmp_path / "src", block=(64, 32))
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "src"), str(out), "--dtype", "bf16", "--quiet"]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == [
        "embed_tokens.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.norm.weight",
        "layers.0.self_attn.o_proj.weight",
    ]
    for name in SHAPES:
        want = reference(held[name], held[name + "_scale_inv"], (64, 32)).to(torch.bfloat16)
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want), name
    assert torch.equal(got["layers.0.norm.weight"], held["layers.0.norm.weight"].to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config == {"torch_dtype": "bfloat16"}  # the weights are values now: no quantization_config


def test_load_into_a_model_of_values_dequantises(tmp_path: Path) -> None:
    held = fp8_checkpoint(tmp_path)
    dest = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    dest |= {"layers.0.norm.weight": torch.zeros(17), "embed_tokens.weight": torch.zeros(7, 17, dtype=torch.bfloat16)}
    result = load(dest, tmp_path)
    assert result.missing == () and result.unexpected == ()  # the scales are part of their weights
    for name in SHAPES:
        want = reference(held[name], held[name + "_scale_inv"], (128, 128)).to(torch.bfloat16)
        assert torch.equal(dest[name], want), name


def test_convert_to_dcp_dequantises_too(tmp_path: Path) -> None:
    held = fp8_checkpoint(tmp_path / "src")
    out = tmp_path / "dcp"
    assert main(["convert", str(tmp_path / "src"), str(out), "--to", "dcp", "--dtype", "fp32", "--quiet"]) == 0
    got = dict(full_params(out))
    name = "layers.0.self_attn.o_proj.weight"
    assert torch.equal(got[name], reference(held[name], held[name + "_scale_inv"], (128, 128)))
    assert not [k for k in got if k.endswith("_scale_inv")]


def test_convert_without_dtype_keeps_codes_and_scales(tmp_path: Path) -> None:
    held = fp8_checkpoint(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--quiet"]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(held)
    for name, t in held.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_save_hf_quantize_reads_back(tmp_path: Path) -> None:
    state = {
        "model.layers.0.mlp.up_proj.weight": arange_tensor((300, 17), step=0.0137, start=-30),
        "model.layers.0.self_attn.q_proj.weight": arange_tensor((129, 257), step=-0.001, start=9),
        "model.layers.0.mlp.gate.weight": arange_tensor((3, 17)),
        "model.layers.0.input_layernorm.weight": arange_tensor((17,), step=0.5),
        "model.embed_tokens.weight": arange_tensor((11, 17)),
        "lm_head.weight": arange_tensor((11, 17)),
    }
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    out = tmp_path / "out"
    save_hf(state, out, quantize="fp8", config_from=tmp_path / "model", max_file_size=40_000)
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    linear = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert sorted(written) == sorted([*state, *(n + "_scale_inv" for n in linear)])
    back = dict(full_params(Fp8Source(out)))  # reading back through shardsync: the values
    assert sorted(back) == sorted(state)
    for name in linear:
        q, s = written[name], written[name + "_scale_inv"]
        assert q.dtype == E4M3 and s.shape == scale_shape(state[name].shape, (128, 128))
        assert torch.equal(back[name], reference(q, s, (128, 128)))
        err = (back[name] - state[name]).abs()
        assert (err <= state[name].abs() * 2**-4 + s.max() * 2**-10).all(), name
    for name in set(state) - set(linear):  # embeddings, norms, lm_head, router: as they were
        assert torch.equal(written[name], state[name]), name
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"],
    }


def test_convert_quantize_fp8_with_a_block(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    w = arange_tensor((33, 20), step=0.25, start=-70)
    save_file({"a.weight": w, "a.norm.weight": torch.ones(20)}, str(src / "model.safetensors"))
    assert (
        main(
            [
                "convert",
                str(src),
                str(tmp_path / "out"),
                "--quantize",
                "fp8",
                "--quantize-block",
                "16,8",
                "--dtype",
                "bf16",
                "--quiet",
            ]
        )
        == 0
    )
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    q, s = quantize(w, (16, 8))
    assert torch.equal(got["a.weight"].float(), q.float()) and torch.equal(got["a.weight_scale_inv"], s)
    assert got["a.norm.weight"].dtype == torch.bfloat16  # not quantised: cast as asked


def test_from_pretrained_loads_the_written_quantization_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    # transformers 5.24 dequantises on load with a block of (weight dims // scale grid): dims that are
    # not multiples of the block (partial blocks, which DeepSeek's and vLLM's kernels read) come out
    # wrong there, so this model's Linear dims are multiples of 128
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "model")
    save_hf(model.state_dict(), tmp_path / "fp8", quantize="fp8", config_from=tmp_path / "model")
    # on CPU transformers dequantises FP8 checkpoints as it loads them (a GPU would keep FP8Linear)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    written = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    theirs = dict(loaded.state_dict())
    for name, q in written.items():
        if q.dtype == E4M3:
            assert torch.equal(theirs[name], reference(q, written[name + "_scale_inv"], (128, 128))), name
    assert torch.equal(theirs["lm_head.weight"], model.state_dict()["lm_head.weight"])
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert math.isfinite(float(got.abs().max()))


def test_convert_fp8_flags_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"w": codes((5, 3))}, str(tmp_path / "model.safetensors"))
    assert main(["convert", str(tmp_path), str(tmp_path / "a"), "--quantize", "fp8", "--quantize-block", "0,5"]) == 2
    assert "--quantize-block '0,5' is not a block" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "b"), "--dtype", "bf16"]) == 2
    assert "'w': float8_e4m3fn without scales" in capsys.readouterr().err
    assert not (tmp_path / "b" / "model.safetensors").exists()
    assert (
        main(["convert", str(tmp_path), str(tmp_path / "c"), "--dtype", "bf16", "--cast-unscaled-fp8", "--quiet"]) == 0
    )
    assert torch.equal(load_file(str(tmp_path / "c" / "model.safetensors"))["w"], codes((5, 3)).to(torch.bfloat16))
