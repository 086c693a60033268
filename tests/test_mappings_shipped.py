"""Shipped mappings: found by name, parameterised from params or a model config, and the variants of
a Megatron GPT that users hit on day one (q/k/v biases, tied embeddings, Transformer Engine names, a
``module.`` prefix, a padded vocabulary), each checked exactly against a plain reshape reference on
arange tensors. Also: sources a mapping leaves unconsumed (warning, ``unconsumed``, ``strict``)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import shardsync
from reference import arange_tensor
from shardsync.errors import MappingError
from shardsync.layout import GlobalLayout, LocalShard, local_layout
from shardsync.mapping import Mapping, resolve, shipped, shipped_mappings, shipped_parameters, unconsumed

H, G, D, HID, FFN, VOCAB, LAYERS = 4, 2, 2, 6, 5, 11, 2  # 4 heads in 2 groups of head dim 2
PER = H // G
PARAMS = {"num_heads": H, "num_key_value_groups": G, "vocab_size": VOCAB}


def tp2(t: torch.Tensor, dim: int) -> list[LocalShard]:
    """Both TP=2 shards of ``t`` (cut along ``dim``), held by this one process."""
    assert t.shape[dim] % 2 == 0, "Megatron's shards are equal"
    half = t.shape[dim] // 2
    offsets = [[0] * t.dim(), [0] * t.dim()]
    offsets[1][dim] = half
    return [LocalShard(t.narrow(dim, i * half, half), t.shape, offsets[i]) for i in range(2)]


def megatron(
    *,
    rows: int = VOCAB,
    qkv_bias: bool = False,
    tied: bool = False,
    te: bool = False,
) -> dict[str, torch.Tensor]:
    """A tiny Megatron GPT state under global names; tensor i is arange from 1000 * i."""
    shapes = {"embedding.word_embeddings.weight": (rows, HID), "decoder.final_layernorm.weight": (HID,)}
    if not tied:
        shapes["output_layer.weight"] = (rows, HID)
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        norms = (
            ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
            if te
            else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
        )
        shapes |= {
            p + norms[0]: (HID,),
            p + norms[1]: (HID,),
            p + "self_attention.linear_qkv.weight": ((H + 2 * G) * D, HID),
            p + "self_attention.linear_proj.weight": (HID, H * D),
            p + "mlp.linear_fc1.weight": (2 * FFN, HID),
            p + "mlp.linear_fc2.weight": (HID, FFN),
        }
        if qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = ((H + 2 * G) * D,)
    return {k: arange_tensor(s, start=1000 * i) for i, (k, s) in enumerate(shapes.items())}


def hf(mg: dict[str, torch.Tensor], *, te: bool = False) -> dict[str, torch.Tensor]:
    """Megatron -> HF written out plainly: reshape per query group, halve fc1, cut the vocabulary."""
    out = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:VOCAB],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
    }
    if "output_layer.weight" in mg:
        out["lm_head.weight"] = mg["output_layer.weight"][:VOCAB]
    for i in range(LAYERS):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        norms = (
            ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
            if te
            else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
        )
        out |= {
            h + "input_layernorm.weight": mg[m + norms[0]],
            h + "post_attention_layernorm.weight": mg[m + norms[1]],
            h + "self_attn.o_proj.weight": mg[m + "self_attention.linear_proj.weight"],
            h + "mlp.gate_proj.weight": mg[m + "mlp.linear_fc1.weight"][:FFN],
            h + "mlp.up_proj.weight": mg[m + "mlp.linear_fc1.weight"][FFN:],
            h + "mlp.down_proj.weight": mg[m + "mlp.linear_fc2.weight"],
        }
        for kind in ("weight", "bias"):
            if m + f"self_attention.linear_qkv.{kind}" not in mg:
                continue
            w = mg[m + f"self_attention.linear_qkv.{kind}"]
            groups = w.reshape(G, (PER + 2) * D, -1)
            out |= {
                h + f"self_attn.q_proj.{kind}": groups[:, : PER * D].reshape(H * D, -1).squeeze(-1),
                h + f"self_attn.k_proj.{kind}": groups[:, PER * D : (PER + 1) * D].reshape(G * D, -1).squeeze(-1),
                h + f"self_attn.v_proj.{kind}": groups[:, (PER + 1) * D :].reshape(G * D, -1).squeeze(-1),
            }
    return out


def run(state: dict, mapping: shardsync.Mapping) -> dict[str, torch.Tensor]:
    return dict(shardsync.full_params(state, mapping))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and torch.equal(got[k], v), k


def llama(name: str = "megatron-llama", **kw: object) -> Mapping:
    return Mapping.parse(name, params=PARAMS, **kw)  # type: ignore[arg-type]


# -- found by name ----------------------------------------------------------------------------------


def test_shipped_mappings_are_listed_by_name_with_a_description() -> None:
    names = shipped_mappings()
    assert list(names) == [
        "megatron-llama",
        "megatron-llama-te",
        "megatron-mixtral",
        "megatron-mixtral-grouped",
        "megatron-mixtral-te",
        "megatron-qwen2-moe",
        "megatron-qwen2-moe-grouped",
        "megatron-qwen2-moe-te",
    ]
    assert names["megatron-llama"] == "Megatron-core GPT, local layer spec -> HuggingFace Llama, Mistral, Qwen2"
    assert "Transformer Engine" in names["megatron-llama-te"]
    assert shipped_parameters("megatron-llama-te") == ["vocab_size", "num_heads", "num_key_value_groups"]


def test_a_name_reads_the_shipped_file() -> None:
    path = shipped.SHIPPED_DIR / "megatron-llama.txt"
    assert llama() == Mapping.parse(path, params=PARAMS) == Mapping.parse(str(path), params=PARAMS)
    assert llama().statements[0].render() == (
        "embedding.word_embeddings.weight -> model.embed_tokens.weight, axis=0, keep=11"
    )


def test_an_unknown_name_lists_the_shipped_ones() -> None:
    with pytest.raises(MappingError) as info:
        Mapping.parse("megatron-lama")
    assert str(info.value) == (
        "'megatron-lama' is not a shipped mapping, a mapping file or a statement (a statement has '->'); "
        "did you mean 'megatron-llama' or 'megatron-llama-te' or 'megatron-mixtral'?\nshipped mappings:\n"
        "  megatron-llama: Megatron-core GPT, local layer spec -> HuggingFace Llama, Mistral, Qwen2\n"
        "  megatron-llama-te: Megatron-core GPT, Transformer Engine layer spec -> HuggingFace Llama, "
        "Mistral, Qwen2\n"
        "  megatron-mixtral: Megatron-core MoE GPT (SequentialMLP experts), local layer spec -> HuggingFace "
        "Mixtral\n"
        "  megatron-mixtral-grouped: Megatron-core MoE GPT (GroupedMLP experts), local layer spec -> "
        "HuggingFace Mixtral\n"
        "  megatron-mixtral-te: Megatron-core MoE GPT (SequentialMLP or TEGroupedMLP experts), Transformer "
        "Engine layer spec -> HuggingFace Mixtral\n"
        "  megatron-qwen2-moe: Megatron-core MoE GPT (SequentialMLP experts), local layer spec -> HuggingFace "
        "Qwen2-MoE, Qwen3-MoE\n"
        "  megatron-qwen2-moe-grouped: Megatron-core MoE GPT (GroupedMLP experts), local layer spec -> "
        "HuggingFace Qwen2-MoE, Qwen3-MoE\n"
        "  megatron-qwen2-moe-te: Megatron-core MoE GPT (SequentialMLP or TEGroupedMLP experts), Transformer "
        "Engine layer spec -> HuggingFace Qwen2-MoE, Qwen3-MoE"
    )
    with pytest.raises(MappingError, match="mapping file 'megatron-llama' does not exist"):
        Mapping.parse("./megatron-llama")  # a path is a path, never a shipped name
    with pytest.raises(MappingError, match="'../megatron-llama' is not a shipped mapping"):
        shipped_parameters("../megatron-llama")


def test_every_verb_takes_a_shipped_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiny.txt").write_text("# Tiny: w to its HF name\nw -> model.w, axis=1, keep=2\n")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    state = {"w": arange_tensor((2, 3))}
    assert shipped_mappings() == {"tiny": "Tiny: w to its HF name"}
    assert torch.equal(dict(shardsync.full_params(state, "tiny"))["model.w"], torch.tensor([[0.0, 1], [3, 4]]))
    assert shardsync.explain(state, "tiny").splitlines()[0] == "model.w  [2, 2] float32  (1 piece from w)"
    assert [t.name for t in shardsync.plan(state, "tiny").targets] == ["model.w"]
    assert [t.name for t in resolve("tiny", GlobalLayout.merge([local_layout(state)]))] == ["model.w"]


def test_a_name_without_its_parameters_says_how_to_give_them() -> None:
    with pytest.raises(MappingError) as info:
        dict(shardsync.full_params(megatron(), "megatron-llama"))
    assert str(info.value) == (
        "mapping 'megatron-llama' needs the parameters vocab_size, num_heads, num_key_value_groups: pass "
        "params={'vocab_size': ..., 'num_heads': ..., 'num_key_value_groups': ...} to "
        "shardsync.Mapping.parse (command line: --set vocab_size=...), or config= a model config.json or "
        "its directory (with the keys: vocab_size; num_heads or num_attention_heads; num_key_value_groups "
        "or num_key_value_heads or num_query_groups or num_attention_heads)"
    )


# -- parameters -------------------------------------------------------------------------------------


def _heads(m: Mapping) -> tuple[object, object, object]:
    qkv = next(st for st in m.statements if st.has("fused_qkv"))
    return qkv.attr("num_heads"), qkv.attr("num_key_value_groups"), m.statements[0].attr("keep")


def test_parameters_from_a_config_json_its_directory_a_dict_or_a_config_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": false}'
    )
    for config in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        assert _heads(Mapping.parse("megatron-llama", config=config)) == (32, 8, 32000)
    megatron_config = SimpleNamespace(num_attention_heads=16, num_query_groups=4)  # TransformerConfig's keys
    assert _heads(Mapping.parse("megatron-llama", config=megatron_config, params={"vocab_size": 99})) == (16, 4, 99)
    # no GQA key: one group per head; explicit values win over the config, digits count as integers
    assert _heads(Mapping.parse("megatron-llama", config={"num_attention_heads": 12, "vocab_size": 5})) == (12, 12, 5)
    assert _heads(Mapping.parse("megatron-llama", config=tmp_path, params={"num_heads": "64"})) == (64, 8, 32000)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"params": {**PARAMS, "num_head": 3}},
            "mapping 'megatron-llama' has no parameter 'num_head'; did you "
            "mean 'num_heads'? (it takes vocab_size, num_heads, num_key_value_groups)",
        ),
        (
            {"params": {**PARAMS, "num_heads": True}},
            "parameter num_heads = True (given) must be an integer or a string",
        ),
        ({"params": {**PARAMS, "vocab_size": 2.5}}, "parameter vocab_size = 2.5 (given) must be an integer"),
        ({"params": {**PARAMS, "vocab_size": "9" * 30}}, "too large"),
        (
            {"config": {"num_attention_heads": 4}},
            "needs the parameter vocab_size: pass params={'vocab_size': "
            "...} to shardsync.Mapping.parse (command line: --set vocab_size=...), or config= a model config.json "
            "or its directory (the config given has none of the keys: vocab_size)",
        ),
        ({"config": "/nonexistent/dir/config.json"}, "model config '/nonexistent/dir/config.json' does not exist"),
    ],
)
def test_parameter_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(MappingError) as info:
        Mapping.parse("megatron-llama", **kwargs)
    assert message in str(info.value)


def test_bad_config_files_and_parameters_on_a_parsed_mapping(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4,\n "vocab_size": }')
    with pytest.raises(MappingError, match=r"config.json, line 2, column 16: invalid JSON"):
        Mapping.parse("megatron-llama", config=tmp_path)
    (tmp_path / "config.json").write_text("[4]")
    with pytest.raises(MappingError, match="holds a JSON list, not an object"):
        Mapping.parse("megatron-llama", config=tmp_path)
    with pytest.raises(MappingError, match="this Mapping is parsed already"):
        Mapping.parse(llama(), params=PARAMS)
    with pytest.raises(MappingError, match="has no parameter 'x' .it takes no parameters"):
        Mapping.parse("w -> v", params={"x": 1})


# -- day-one variants, exact ------------------------------------------------------------------------


def test_llama_from_tp_shards_exact_and_nothing_left_over() -> None:
    mg = megatron(rows=12)  # the vocabulary padded to 12 rows, 6 per rank
    state: dict = dict(mg)
    for key, dim in (
        ("embedding.word_embeddings.weight", 0),
        ("output_layer.weight", 0),
        ("decoder.layers.1.self_attention.linear_qkv.weight", 0),
        ("decoder.layers.1.self_attention.linear_proj.weight", 1),
    ):
        state[key] = tp2(mg[key], dim)
    assert_same(run(state, llama()), hf(mg))
    assert unconsumed(llama(), GlobalLayout.merge([local_layout(state)])) == []


def test_qwen2_qkv_biases_split_like_the_weight() -> None:
    mg = megatron(qkv_bias=True)
    bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    mg[bias] = torch.arange(16.0)  # per group [q head, q head, k head, v head], each 2 wide
    state: dict = {**mg, bias: tp2(mg[bias], 0)}
    got = run(state, llama())
    assert_same(got, hf(mg))
    assert got["model.layers.0.self_attn.q_proj.bias"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert got["model.layers.0.self_attn.k_proj.bias"].tolist() == [4, 5, 12, 13]
    assert got["model.layers.0.self_attn.v_proj.bias"].tolist() == [6, 7, 14, 15]


def test_tied_embeddings_have_no_output_layer_and_no_lm_head() -> None:
    got = run(megatron(tied=True), llama())
    assert "lm_head.weight" not in got
    assert_same(got, hf(megatron(tied=True)))


def test_transformer_engine_names() -> None:
    mg = megatron(te=True, qkv_bias=True)
    assert_same(run(mg, llama("megatron-llama-te")), hf(mg, te=True))
    with pytest.raises(
        MappingError,
        match=r"'decoder.layers.\$LAYER_ID.input_layernorm.weight' matches no "
        "source key",
    ):
        run(mg, llama())


def test_a_module_prefix_is_stripped() -> None:
    mg = megatron(tied=True)
    wrapped = {"module." + k: v for k, v in mg.items()}
    assert_same(run(wrapped, llama(prefix="module.")), hf(mg))
    with pytest.raises(MappingError) as info:
        run(wrapped, llama())
    assert (
        "hint: every source key starts with 'module.' (a wrapped model's state dict): parse the "
        "mapping with prefix='module.'"
    ) in str(info.value)


def test_a_padded_vocabulary_is_trimmed() -> None:
    mg = megatron(rows=16)  # Megatron pads 11 rows to a multiple of 128 x TP; here to 16, 8 per rank
    state: dict = {**mg, "embedding.word_embeddings.weight": tp2(mg["embedding.word_embeddings.weight"], 0)}
    got = run(state, llama())
    assert_same(got, hf(mg))
    assert got["model.embed_tokens.weight"][:, 0].tolist() == [6.0 * r for r in range(11)]
    with pytest.raises(
        MappingError,
        match=r"keep=17 must be a positive integer at most 16, the size of dim 0 "
        r"of 'embedding.word_embeddings.weight' \(shape \[16, 6\]\)",
    ):
        run(mg, Mapping.parse("megatron-llama", params={**PARAMS, "vocab_size": 17}))


def test_reverse_loads_hf_names_into_megatron_names() -> None:
    for te in (False, True):
        mg = megatron(qkv_bias=True, tied=True, te=te)
        name = "megatron-llama-te" if te else "megatron-llama"
        back = run(hf(mg, te=te), llama(name, reverse=True))
        assert_same(back, mg)  # biases rebuilt group by group; no output_layer without lm_head
    back = run(hf(megatron()), llama(reverse=True, prefix="module."))
    assert_same(back, {"module." + k: v for k, v in megatron().items()})


# -- sources left unconsumed ------------------------------------------------------------------------


def test_unconsumed_sources_are_listed_warned_about_and_refused_when_strict(caplog: pytest.LogCaptureFixture) -> None:
    state: dict = {
        **megatron(),
        "decoder.layers.0.mlp.extra_scale.weight": arange_tensor((3, HID)),
        "decoder.layers.1.mlp.extra_scale.weight": arange_tensor((3, HID)),
    }
    layout = GlobalLayout.merge([local_layout(state)])
    extras = ["decoder.layers.0.mlp.extra_scale.weight", "decoder.layers.1.mlp.extra_scale.weight"]
    assert unconsumed(llama(), layout) == extras
    with caplog.at_level(logging.WARNING, logger="shardsync.mapping.resolver"):
        got = run(state, llama())
    assert torch.equal(got[extras[1]], state[extras[1]])  # passed through under its own name
    assert [r.getMessage() for r in caplog.records] == [
        f"the mapping leaves 2 sources unconsumed; they pass through under their own names: {extras[0]!r}, "
        f"{extras[1]!r}"
    ]
    message = (
        f"the mapping leaves 2 sources unconsumed: {extras[0]!r}, {extras[1]!r}; map each with a "
        "statement or drop it (`name -> _`), or resolve without strict"
    )
    with pytest.raises(MappingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(llama(), layout, strict=True)
    with pytest.raises(MappingError, match="leaves 2 sources unconsumed"):
        run(state, llama(strict=True))  # a strict Mapping is strict in every verb
    assert len(resolve(llama(strict=True), layout, strict=False)) == len(got)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardsync.mapping.resolver"):
        resolve(None, layout, strict=True)  # no mapping: everything passes through by design
    assert caplog.records == []
