"""The model settings a Megatron checkpoint keeps in its ``common.pt``, read without running its code.

Megatron's training loop saves its arguments with every checkpoint (``generate_state_dict`` in
``megatron/training/checkpointing.py``: ``state_dict['args'] = args``, an ``argparse.Namespace``), and
``dist_checkpointing.save`` puts everything that is not a sharded tensor in ``common.pt``. The
arguments name the model (``num_attention_heads``, ``num_query_groups``, ``num_layers``,
``num_experts``, ...), so a shipped mapping's parameters can come from there when the checkpoint has no
``config.json``.

``torch.load(weights_only=True)`` refuses that file: besides the ``Namespace`` it holds Megatron's own
enums and dataclasses (the ``SAFE_GLOBALS`` megatron-core registers with torch, e.g. ``AttnBackend``),
which only an installed Megatron can import. :func:`load_common` unpickles it with torch's loader and
a restricted unpickler instead: plain containers (``Namespace``, ``SimpleNamespace``,
``OrderedDict``, paths), tensors and dtypes are built; every other name the file gives becomes an
inert :class:`Opaque` stand-in that records its arguments and is never imported or run. A crafted
file (``os.system`` by ``__reduce__``) gives a stand-in, not a command.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import pickle
import types
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError

__all__ = ["Opaque", "load_common", "checkpoint_config"]

#: ``(module, name) -> object`` the unpickler builds for real: plain data only.
_PLAIN: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # the path as data, nothing touched on disk
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,  # what weights_only allows
    ("torch", "Size"): torch.Size,
}


class Opaque:
    """An object of a class the file names but the reader does not build: its name and what the file
    gave it (arguments, state), nothing more.

    Example:
        >>> o = Opaque.named("megatron.core.transformer.enums", "AttnBackend")(5)
        >>> o.qualname, o.args
        ('megatron.core.transformer.enums.AttnBackend', (5,))
    """

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname} {self.args!r}>"

    @classmethod
    def named(cls, module: str, name: str) -> type[Opaque]:
        """A stand-in class for ``module.name``."""
        return type(name, (cls,), {"qualname": f"{module}.{name}"})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return Opaque.named(module, name)


def _load(fh: Any, **kwargs: Any) -> Any:
    return _Unpickler(fh, **kwargs).load()


# torch.load takes the unpickler from this module-like object (its pickle_module): the zip format
# through Unpickler, the legacy format through load as well
_RESTRICTED = types.SimpleNamespace(Unpickler=_Unpickler, load=_load, __name__="shardsync_restricted_pickle")


def load_common(path: str | Path) -> Any:
    """A ``common.pt`` (any ``torch.save`` file), built as the module docstring says.

    Raises:
        FormatError: the file is not a torch.save file, or ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` is set (torch
            then takes no reader but its own).

    Example:
        >>> import tempfile, argparse
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save({"args": argparse.Namespace(num_layers=2)}, f"{d}/common.pt")
        ...     load_common(f"{d}/common.pt")["args"].num_layers
        2
    """
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise FormatError(
            f"{path}: TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, and torch then refuses the restricted reader "
            "shardsync reads Megatron's saved args with (it builds no object the file names, but torch "
            "takes only its own weights_only reader); unset the variable for this command, or give the "
            "mapping's parameters with --set / a config.json"
        )
    try:
        # weights_only=False only because torch refuses a pickle_module otherwise: _Unpickler builds
        # nothing beyond _PLAIN and dtypes, whatever the file names
        return torch.load(path, map_location="cpu", pickle_module=_RESTRICTED, weights_only=False)
    except (
        OSError,
        RuntimeError,
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        RecursionError,
    ) as exc:
        raise FormatError(
            f"{path}: cannot read it as a torch.save file: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc


def _as_dict(value: Any) -> dict[str, Any] | None:
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return dict(vars(value))
    if isinstance(value, Opaque) and isinstance(value.state, dict):  # e.g. a dataclass config
        return dict(value.state)
    return dict(value) if isinstance(value, dict) else None


def checkpoint_config(path: str | Path) -> dict[str, Any] | None:
    """The model settings of a Megatron checkpoint directory, from the ``args`` (or ``config``) its
    ``common.pt`` holds; None when it holds neither.

    Megatron's ``--num-query-groups`` defaults to 1 and counts only with ``--group-query-attention``:
    without it the value is dropped, so that ``num_key_value_groups`` falls back to the head count.
    ``vocab_size`` is Megatron's ``--vocab-size`` when given; ``padded_vocab_size`` is not the
    tokenizer's, so a run that took its vocabulary from a tokenizer still needs ``--set vocab_size=``.

    Example:
        >>> import tempfile, argparse
        >>> args = argparse.Namespace(num_attention_heads=8, num_query_groups=1,
        ...                           group_query_attention=False)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save({"args": args}, f"{d}/common.pt")
        ...     checkpoint_config(d)
        {'num_attention_heads': 8, 'group_query_attention': False}
    """
    common = load_common(Path(path) / "common.pt")
    if not isinstance(common, dict):
        return None
    found = next((d for d in map(_as_dict, (common.get("args"), common.get("config"))) if d is not None), None)
    if found is None:
        return None
    if found.get("group_query_attention") is False:
        found.pop("num_query_groups", None)
    return found
