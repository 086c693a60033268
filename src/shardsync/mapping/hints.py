"""Hints added to a mapping's errors when the source explains them: a wrapper's ``module.`` prefix,
or a mixture-of-experts model read with a dense mapping."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from .program import Mapping
from .syntax import Diagnostic

__all__ = ["with_prefix_hint", "with_moe_hint", "moe_hint"]

#: Names only a mixture-of-experts layer has (Megatron's and HuggingFace's).
_MOE = re.compile(r"\.(experts|router|block_sparse_moe)\.")


def with_prefix_hint(diags: list[Diagnostic], keys: Sequence[str], program: Mapping) -> list[Diagnostic]:
    """A hint on each name that matches nothing when every source key carries a wrapper's
    ``module.`` prefix (a DDP-wrapped state dict) and the mapping has no ``prefix``."""
    wrapper = re.match(r"(?:module\.)+", min(keys, default="")) if not program.reverse else None
    if wrapper is None or program.prefix or not all(k.startswith(wrapper.group()) for k in keys):
        return diags
    hint = (
        f"every source key starts with {wrapper.group()!r} (a wrapped model's state dict): parse the "
        f"mapping with prefix={wrapper.group()!r}"
    )
    return [
        replace(d, hints=d.hints + (hint,))
        if "matches no source key" in d.message or d.message.startswith("unknown name")
        else d
        for d in diags
    ]


def moe_hint(keys: Sequence[str], program: Mapping) -> str | None:
    """What to use instead when ``program`` has no expert lines and the source is an MoE model.

    Example:
        >>> moe_hint(["decoder.layers.0.mlp.router.weight"], Mapping.parse("megatron-llama",
        ...     params={"num_heads": 2, "num_key_value_groups": 1, "vocab_size": 8}))[:60]
        "the source holds mixture-of-experts tensors (e.g. 'decoder.l"
    """
    if any(_MOE.search(n.text) for st in program.statements for n in st.left + st.right):
        return None
    found = next((k for k in keys if ".router." in k), None) or next((k for k in keys if _MOE.search(k)), None)
    if found is None:
        return None
    if any(k.endswith("mlp.experts.weight1") for k in keys):
        kinds = "-grouped"  # Megatron's GroupedMLP
    elif any(k.endswith("linear_qkv.layer_norm_weight") for k in keys):
        kinds = "-te"  # the Transformer Engine layer spec
    else:
        kinds = ""
    names = [f"megatron-mixtral{kinds}", f"megatron-qwen2-moe{kinds}"]
    if any(".shared_expert" in k for k in keys):
        names.reverse()
    which = (
        ""
        if kinds
        else (" (their -te variants for the Transformer Engine layer spec, -grouped for GroupedMLP experts)")
    )
    return (
        f"the source holds mixture-of-experts tensors (e.g. {found!r}) and this mapping has no expert "
        f"lines: use the shipped {names[0]!r} or {names[1]!r}{which}, which read the router and every "
        "expert (and dense layers among them)"
    )


def with_moe_hint(diags: list[Diagnostic], keys: Sequence[str], program: Mapping) -> list[Diagnostic]:
    """The :func:`moe_hint` on the first name that matches no source key (once: it is about the model,
    not about one statement)."""
    hint = moe_hint(keys, program)
    first = next((i for i, d in enumerate(diags) if "matches no source key" in d.message), None)
    if hint is None or first is None:
        return diags
    return [replace(d, hints=d.hints + (hint,)) if i == first else d for i, d in enumerate(diags)]
