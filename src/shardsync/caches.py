"""What shardsync keeps between calls, and :func:`release`, which gives all of it back.

Between calls each process keeps, to make the next call of a training loop cheap: the plans of the
last layouts (``full_params``, ``load``, ``reshard``: a step that streams the same layout plans
once), the shared-memory segments and mappings of the same-host transport, the subgroups of
multicast plans, and a pool of recycled target memory. Per-group caches are keyed weakly by the
default process group, so a group made after ``destroy_process_group()`` never finds what an earlier
one left; :func:`release` drops everything at once.
"""

from __future__ import annotations

__all__ = ["release"]


def release() -> None:
    """Free every cache, pool and segment shardsync keeps between calls, in this process.

    Call it on every rank (e.g. before ``destroy_process_group()``, or when the weights will not be
    streamed again); the next call plans and sets up afresh. Nothing collective happens.

    Example:
        >>> import torch, shardsync
        >>> _ = [t for _, t in shardsync.full_params({"w": torch.zeros(3)})]
        >>> shardsync.release()
    """
    from .exec.memory import release_memory
    from .exec.multicast import release_subgroups
    from .exec.registry import release_shm_plans
    from .exec.shm_segments import release_all
    from .pipeline import release_plans

    release_plans()
    release_shm_plans()
    release_subgroups()
    release_all()
    release_memory()
