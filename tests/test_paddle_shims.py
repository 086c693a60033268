"""The Paddle-compatible names live in shardsync.paddle; the old top-level names warn and still work."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardsync
import shardsync.paddle


@pytest.mark.parametrize("name", ["full_param", "add_extra_synchronization"])
def test_top_level_paddle_name_warns_and_is_the_paddle_function(name: str) -> None:
    assert name not in shardsync.__all__
    assert name in shardsync.paddle.__all__
    with pytest.warns(DeprecationWarning, match=rf"shardsync\.{name} is deprecated.*shardsync\.paddle import {name}"):
        got = getattr(shardsync, name)
    assert got is getattr(shardsync.paddle, name)


def test_from_import_of_a_moved_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="shardsync.paddle"):
        from shardsync import full_param  # noqa: F401


def test_new_place_and_other_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from shardsync.paddle import add_extra_synchronization, full_param  # noqa: F401

        assert callable(shardsync.full_params)
        assert "full_params" in shardsync.__all__


def test_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="full_paramz"):
        shardsync.full_paramz  # type: ignore[attr-defined]  # noqa: B018


def test_sharded_tensor_is_the_deprecated_name_of_local_shard() -> None:
    import shardsync.layout

    for module in (shardsync, shardsync.layout):
        with pytest.warns(
            DeprecationWarning, match="shardsync.ShardedTensor is deprecated: it is shardsync.LocalShard"
        ):
            cls = module.ShardedTensor
        assert cls is shardsync.LocalShard
    shard = shardsync.LocalShard(torch.arange(3.0), (5,), (2,))
    assert isinstance(shard, cls) and shard.box == shardsync.Box((2,), (3,))
