"""PaddlePaddle-compatible entry points: code written for Paddle ports by changing its imports.

* :func:`full_param` - FlexCheckpoint's ``full_param`` (keyword names and defaults), on
  :func:`shardsync.full_params`.
* :func:`add_extra_synchronization` - Paddle's tensor-parallel extra synchronization, on
  :class:`~shardsync.replicas.ReplicaSync`; :func:`paddle_filter` applies Paddle's selection rules.

They live here only: ``full_param`` is one letter from :func:`shardsync.full_params`, so the top level
does not export it. ``shardsync.full_param`` and ``shardsync.add_extra_synchronization`` still resolve,
with a :class:`DeprecationWarning` naming this module.

Example:
    >>> from shardsync.paddle import full_param
    >>> full_param.__module__
    'shardsync.paddle.stream'

"""

from __future__ import annotations

from .replicas import add_extra_synchronization, paddle_filter
from .stream import PADDLE_KEYWORDS, full_param

__all__ = ["full_param", "PADDLE_KEYWORDS", "add_extra_synchronization", "paddle_filter"]
