"""Paddle 3.3.1 ``full_param`` on the peers workload (runs in the peers venv, never in shardsync's).

``--mode single``: one process holding the full weights (``SingleCommGroupFullParamAssembler`` on one
card). ``--mode group`` / ``--mode mesh``: started by ``python -m paddle.distributed.launch
--nproc_per_node 2`` on CPU (gloo), TP=2 shards; ``group`` is Paddle's single-group broadcast path,
``mesh`` its 2-D mesh path (``h_group`` = both ranks, ``v_group`` = this rank alone: a 1x2 mesh).
Every yielded tensor is checked against the numpy reference on the first repeat. Writes one JSON line
per rank: ``{"mode", "rank", "seconds": [...], "omp_num_threads": {"before import", "after import"}}``
to ``--out.RANK`` (the environment's ``OMP_NUM_THREADS`` before and after ``import paddle``, which
sets it to 1 when it is unset). ``--layers`` as in ``bench_peers.py``.

Paddle's distributed path calls ``Tensor.cuda()`` on CPU tensors before broadcasting
(``dcp/full_param.py:527``), which raises on a CPU build; as in tests/golden/make_paddle_golden.py the
worker makes ``cuda()`` the identity when Paddle has no CUDA. Nothing else is patched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import workload as W  # noqa: E402

__all__ = ["main"]


def state(rank: int, world: int, weights: dict[str, np.ndarray]) -> dict:
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    sd = {}
    for key, w in weights.items():
        local, offset = (w, (0,) * w.ndim) if world == 1 else W.local_shard(w, key, rank, world)
        sd[key] = ShardedWeight(
            key=key,
            local_tensor=paddle.to_tensor(local),
            local_shape=local.shape,
            global_shape=w.shape,
            global_offset=offset,
        )
    return sd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("single", "group", "mesh"), required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=W.LAYERS)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    omp = {"before import": os.environ.get("OMP_NUM_THREADS")}
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param

    omp["after import"] = os.environ.get("OMP_NUM_THREADS")
    paddle.set_device("cpu")
    kw: dict = {}
    rank, world = 0, 1
    if args.mode != "single":
        if not paddle.is_compiled_with_cuda():
            paddle.Tensor.cuda = lambda self, *a, **k: self
        dist.init_parallel_env()
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.mode == "mesh":
            singles = [dist.new_group([r]) for r in range(world)]
            kw = {"h_group": dist.new_group(list(range(world))), "v_group": singles[rank]}
    weights = W.full_weights(args.layers)
    ref = W.reference(weights)
    sd = state(rank, world, weights)
    cfg = {"aoa_statements": list(W.MAPPING)}
    seconds = []
    for rep in range(args.repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        got = 0
        for name, t in full_param(sd, cfg, **kw):
            if rep == 0 and not np.array_equal(t.numpy(), ref[name]):
                raise AssertionError(f"paddle {args.mode}: {name} differs from the reference")
            got += 1
        if world > 1:
            dist.barrier()
        if rep == 0 and got != len(ref):
            raise AssertionError(f"paddle {args.mode}: {got} targets, expected {len(ref)}")
        seconds.append(time.perf_counter() - t0)
    with open(f"{args.out}.{rank}", "w") as fh:
        json.dump({"mode": args.mode, "rank": rank, "seconds": seconds, "omp_num_threads": omp}, fh)


if __name__ == "__main__":
    main()
