"""shardsync reads the caller's tensors without changing them: their storages stay resizable.

torch's ``Tensor.numpy()`` makes a tensor's storage unresizable for good, and FSDP frees and
re-allocates the storage of the parameters it gathers with ``untyped_storage().resize_()``: a stream,
digest, fingerprint or save that viewed a caller's tensor through ``numpy()`` would make that fail
later, far from shardsync. shardsync views them through DLPack instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

import shardsync
from reference import arange_tensor
from shardsync.sources.fingerprint import exact_digest

MAPPING = ["big -> big_a, big_b, axis=1", "half -> half_a, half_b, axis=0", "small^T -> small_t"]


def _state() -> dict[str, torch.Tensor]:
    return {
        "big": arange_tensor((301, 202)),  # above torch's grain: cut in chunks
        "half": arange_tensor((64, 1030), dtype=torch.bfloat16),  # no numpy dtype: moved as int16
        "small": arange_tensor((7, 5), dtype=torch.int32),
    }


def _resizable(state: dict[str, torch.Tensor]) -> dict[str, bool]:
    out = {}
    for name, t in state.items():
        try:
            t.untyped_storage().resize_(t.untyped_storage().nbytes())
            out[name] = True
        except RuntimeError:  # "Trying to resize storage that is not resizable"
            out[name] = False
    return out


def test_streaming_digesting_and_saving_leave_the_callers_storages_resizable(tmp_path: Path) -> None:
    state = _state()
    want = {k: v.clone() for k, v in state.items()}
    got = dict(shardsync.full_params(state, MAPPING))
    assert torch.equal(got["big_b"], want["big"][:, 101:]) and torch.equal(got["half_b"], want["half"][32:])
    assert torch.equal(got["small_t"], want["small"].t())
    shardsync.digest(state, MAPPING)
    shardsync.save_hf(state, tmp_path / "hf", MAPPING)
    [exact_digest(t) for t in state.values()]
    assert _resizable(state) == dict.fromkeys(state, True)
    assert all(torch.equal(state[k], want[k]) for k in state)
    # the check can fail: numpy() is what would have pinned them
    state["big"].numpy()
    assert not _resizable(state)["big"]
