"""The files besides the weights that make a directory load with ``from_pretrained``: ``config.json``,
``generation_config.json`` and the tokenizer's files, copied from a model directory or a list of paths.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from ..errors import FormatError
from .commit import CheckpointNames, fsync_path, mark_stage

__all__ = ["HF_FILES", "extra_files", "copy_files"]

#: The keys a HuggingFace config names the weights' dtype with (transformers 4 and 5).
_DTYPE_KEYS = ("torch_dtype", "dtype")

#: What ``config_from=DIR`` copies when present (``config.json`` must be).
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


def extra_files(
    paths: Iterable[str | os.PathLike] | None, config_from: str | os.PathLike | None, names: CheckpointNames
) -> tuple[Path, ...]:
    """The files to copy next to the weights, checked.

    Args:
        paths: files named one by one.
        config_from: a model directory: its :data:`HF_FILES` that exist.
        names: the checkpoint's own file names, which an extra file may not take.

    Raises:
        FormatError: a missing file, a directory without ``config.json``, a file of ``config_from``
            that is a symbolic link out of it, two files with one name, or a name the weights use.

    Example:
        >>> extra_files(None, None, CheckpointNames())
        ()
    """
    files = [Path(p) for p in (paths or ())]
    problems = []
    if config_from is not None:
        source = Path(config_from)
        if not (source / "config.json").is_file():
            raise FormatError(
                f"config_from={str(source)!r} holds no config.json; give the directory of "
                "a HuggingFace model (where save_pretrained wrote config.json)"
            )
        found = [source / f for f in HF_FILES if (source / f).is_file()]
        problems += [
            f"{p} is a symbolic link to {p.resolve()}, outside {source}" for p in found if not _links_within(p, source)
        ]
        files += found
    problems += [f"{p} is not a file" for p in files if not p.is_file()]
    problems += [
        f"{p} is not a JSON object" for p in files if p.name == "config.json" and p.is_file() and not _is_json_object(p)
    ]
    problems += [f"{p.name} is a name the weights use" for p in files if names.is_own(p.name)]
    by_name: dict[str, Path] = {}
    for p in files:
        if by_name.setdefault(p.name, p) != p:
            problems.append(f"{by_name[p.name]} and {p} have the same name")
    if problems:
        raise FormatError("cannot copy the extra files: " + "; ".join(problems) + " (fix extra_files or config_from)")
    return tuple(by_name.values())


def _links_within(path: Path, source: Path) -> bool:
    """Whether ``path`` (a file of ``source``) is no link, or one that stays within ``source`` or, in
    a Hugging Face cache (``.../snapshots/<revision>/``), within that repository's ``blobs``."""
    if not path.is_symlink():
        return True
    target, root = path.resolve(), source.resolve()
    roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    return any(target.is_relative_to(r) for r in roots)


def copy_files(
    files: Iterable[Path],
    directory: Path,
    names: CheckpointNames,
    tag: str,
    dtype: str | None = None,
    quantization: dict[str, Any] | None | Literal["keep"] = "keep",
) -> None:
    """Copy each file into ``directory``, replacing a file of that name atomically (temp, fsync,
    rename), with the file's permission bits. With ``dtype`` (the weights were cast), ``config.json``
    says that dtype, so that ``from_pretrained(dtype="auto")`` loads them as written; ``quantization``
    (unless ``"keep"``) replaces its ``quantization_config`` (None: removes it, for weights that are no
    longer quantised)."""
    copied = False
    for src in files:
        tmp = directory / names.temp(tag, src.name)
        if src.name == "config.json" and (dtype is not None or quantization != "keep"):
            text = src.read_text() if dtype is None else _with_dtype(src.read_text(), dtype)
            tmp.write_text(text if quantization == "keep" else _with_quantization(text, quantization))
        else:
            shutil.copyfile(src, tmp)
        shutil.copymode(src, tmp)  # a private (0600) tokenizer stays private
        fsync_path(tmp)
        os.replace(tmp, directory / src.name)
        mark_stage(f"copied {src.name}")
        copied = True
    if copied:
        fsync_path(directory)


def _with_dtype(config_text: str, dtype: str) -> str:
    """``config.json`` text with its dtype set to ``dtype``.

    Example:
        >>> print(_with_dtype('{"dtype": "float32", "hidden_size": 8}', "bfloat16"), end="")
        {
          "dtype": "bfloat16",
          "hidden_size": 8
        }
    """
    config = json.loads(config_text)  # checked by extra_files
    keys = [k for k in _DTYPE_KEYS if k in config] or ["torch_dtype"]
    config.update({k: dtype for k in keys})
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _with_quantization(config_text: str, quantization: dict[str, Any] | None) -> str:
    """``config.json`` text with ``quantization_config`` set to ``quantization`` (None: removed).

    Example:
        >>> print(_with_quantization('{"quantization_config": {"quant_method": "fp8"}}', None), end="")
        {}
    """
    config = json.loads(config_text)
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _is_json_object(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (ValueError, RecursionError):
        return False
