"""``shardsync convert``: a TP=2 torch DCP checkpoint to HF safetensors on disk, against torch's own routes.

The checkpoint: a Megatron-style Llama (6 layers, hidden 1024, FFN 2816, vocabulary 8192, fp32, about
0.34 GB) written by ``shardsync.save`` on 2 gloo ranks, each holding its tensor-parallel shards
(column-parallel QKV/FC1/embeddings cut along dim 0, row-parallel projections along dim 1, norms
replicated): two ``.distcp`` files, as a TP=2 training job leaves them.

Routes, each in a fresh child process that times the conversion alone and reports its peak resident
memory (``VmHWM``; for two ranks, the larger). Every route is timed under the same import state:
every module any route uses (:data:`IMPORTS`: shardsync's writer and DCP reader, torch DCP, its HF
writer and fsspec storage, DTensor and the torch._dynamo it loads, safetensors) is imported in every
process before the route starts, so that no window pays an import another route paid before its
timer (shardsync loads torch DCP on first use). The modules still imported during a route's call
(its set-up or its window) are recorded and listed in the results: none, while the list is
complete. Outside the window: the interpreter's start, the imports and a route's set-up (the torch
routes allocate their empty destination tensors, the ``save_file`` baselines load the tensors).
torch's default threads in every process (nothing here sets them):

* ``shardsync``: ``save_hf(dcp_dir, out)`` in one process (what ``shardsync convert`` runs), on 2
  gloo ranks (``convert --nproc 2``, less the launcher) writing one file and writing 100 MB files,
  and with the Megatron -> HF mapping;
* ``torch dcp_to_torch_save``: ``format_utils.dcp_to_torch_save`` to a ``.pt`` file, ``torch.load``,
  then ``safetensors.torch.save_file``;
* ``torch HF writer (1 process)``: ``dcp.load`` into full tensors, then ``dcp.save`` with
  ``HuggingFaceStorageWriter`` (rank-0 checkpointing);
* ``torch HF writer (2 ranks)``: each rank ``dcp.load``\\ s its shards as DTensors, then ``dcp.save``
  with ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` (torch's
  consolidation into one file);
* live DTensor TP=2 -> HF (``live_*``, 2 ranks): a trainer's DTensor state (built before the timer)
  written as one HF file by ``shardsync.save_hf(state, out)`` and by ``dcp.save`` with
  ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``;
* baseline ``save_file``: ``safetensors.torch.save_file`` of the same tensors, already in memory
  (the write alone), with and without an fsync (shardsync fsyncs every file it commits).

Also, on a line of its own, the end-to-end wall time of the command (``python -m shardsync convert``,
interpreter start and every import included). Rounds interleave the routes; medians are reported.
Goal (issue 17): >= 2x the speed of the fastest torch route, within 1.5x of ``save_file`` + fsync.
Run: ``make bench`` or ``.venv/bin/python bench/bench_convert.py`` (``--runs``, ``--rounds``;
``BENCH_LAYERS=1 ... --runs 1 --rounds 1 --out /tmp/x`` for a quick check); ``--busy`` measures next
to another busy process (bench/busy.py). Writes bench/results/convert.{json,md} (``convert_busy.*`` with ``--busy``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402

LAYERS = int(os.environ.get("BENCH_LAYERS", "6"))  # fewer for a quick try
HIDDEN, FFN, VOCAB, HEADS, GROUPS = 1024, 2816, 8192, 16, 4
HEAD = HIDDEN // HEADS
RESULTS = Path(__file__).parent / "results"
MAPPING = "\n".join(
    [
        "embedding.word_embeddings.weight -> model.embed_tokens.weight",
        "decoder.final_layernorm.weight -> model.norm.weight",
        "output_layer.weight -> lm_head.weight",
        "decoder.layers.$L.self_attention.linear_qkv.weight -> model.layers.$L.self_attn.q_proj.weight, "
        "model.layers.$L.self_attn.k_proj.weight, model.layers.$L.self_attn.v_proj.weight, fused_qkv, "
        f"num_heads={HEADS}, num_key_value_groups={GROUPS}, axis=0",
        "decoder.layers.$L.self_attention.linear_proj.weight -> model.layers.$L.self_attn.o_proj.weight",
        "decoder.layers.$L.mlp.linear_fc1.weight -> model.layers.$L.mlp.gate_proj.weight, "
        "model.layers.$L.mlp.up_proj.weight, fused_ffn, axis=0, tp=1",
        "decoder.layers.$L.mlp.linear_fc2.weight -> model.layers.$L.mlp.down_proj.weight",
        "decoder.layers.$L.input_layernorm.weight -> model.layers.$L.input_layernorm.weight",
        "decoder.layers.$L.pre_mlp_layernorm.weight -> model.layers.$L.post_attention_layernorm.weight",
    ]
)


def full_state() -> dict[str, tuple[torch.Tensor, int | None]]:
    """Every tensor, with the dim tensor parallelism cuts (None: replicated)."""
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    out: dict[str, tuple[torch.Tensor, int | None]] = {
        "embedding.word_embeddings.weight": (randn(VOCAB, HIDDEN), 0),
        "decoder.final_layernorm.weight": (randn(HIDDEN), None),
        "output_layer.weight": (randn(VOCAB, HIDDEN), 0),
    }
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv.weight"] = (randn((HEADS + 2 * GROUPS) * HEAD, HIDDEN), 0)
        out[p + "self_attention.linear_proj.weight"] = (randn(HIDDEN, HIDDEN), 1)
        out[p + "mlp.linear_fc1.weight"] = (randn(2 * FFN, HIDDEN), 0)
        out[p + "mlp.linear_fc2.weight"] = (randn(HIDDEN, FFN), 1)
        out[p + "input_layernorm.weight"] = (randn(HIDDEN), None)
        out[p + "pre_mlp_layernorm.weight"] = (randn(HIDDEN), None)
    return out


# -- running on 2 gloo ranks -------------------------------------------------------------------------


def _rank_entry(rank: int, store: str, fn: Callable[..., Any], args: tuple, out: str) -> None:
    import torch.distributed as dist

    preimport()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    before = set(sys.modules)
    result = fn(rank, *args)
    dist.barrier()
    new = sorted(set(sys.modules) - before)
    Path(out, f"{rank}.json").write_text(json.dumps({"result": result, "peak": _rss("VmHWM"), "new_modules": new}))
    dist.destroy_process_group()


def on_two_ranks(fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_entry, args=(r, f"{tmp}/store", fn, args, tmp)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank failed (exit code {p.exitcode})")
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]


#: Every module a route uses, imported in every process before any timed window (the same import state
#: for every route: shardsync imports torch DCP lazily, on first use, so without this its window would
#: pay imports the torch routes pay before theirs).
IMPORTS = (
    "numpy.ctypeslib",
    "safetensors.torch",
    "shardsync",
    "shardsync.io",
    "shardsync.io.commit",
    "shardsync.sources.dcp",
    "torch._dynamo",  # DTensor's first collective imports it
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint._fsspec_filesystem",  # dcp.load / dcp.save with a checkpoint_id
    "torch.distributed.checkpoint.default_planner",
    "torch.distributed.checkpoint.format_utils",
    "torch.distributed.checkpoint.planner_helpers",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.utils.serialization",
)


def preimport() -> None:
    for name in IMPORTS:
        importlib.import_module(name)


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _timed(rank: int, work: Callable[[], None]) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - t0


# -- the checkpoint ------------------------------------------------------------------------------------


def _write_tp2(rank: int, path: str) -> None:
    import shardsync
    from shardsync.layout import shard_dim

    state = {k: shard_dim(t, dim, rank, 2) if dim is not None else t for k, (t, dim) in full_state().items()}
    shardsync.save(state, path)


# -- the routes (each runs in a child process: `bench_convert.py --route NAME CKPT OUT`) -----------------


def route_shardsync(ckpt: str, out: str) -> float:
    import shardsync

    t0 = time.perf_counter()
    shardsync.save_hf(ckpt, out)
    return time.perf_counter() - t0


def route_shardsync_mapped(ckpt: str, out: str) -> float:
    import shardsync

    t0 = time.perf_counter()
    shardsync.save_hf(ckpt, out, MAPPING)
    return time.perf_counter() - t0


def _shardsync_rank(rank: int, ckpt: str, out: str, max_shard_size: str) -> float:
    import shardsync

    return _timed(rank, lambda: shardsync.save_hf(ckpt, out, max_file_size=max_shard_size))


def route_shardsync_2ranks(ckpt: str, out: str) -> float:
    """One output file (HF's 5GB limit): rank 0 writes it, rank 1 reads and sends its share."""
    return _from_ranks(on_two_ranks(_shardsync_rank, ckpt, out, "5GB"))


def route_shardsync_2ranks_100mb(ckpt: str, out: str) -> float:
    """100 MB files: both ranks write theirs in parallel."""
    return _from_ranks(on_two_ranks(_shardsync_rank, ckpt, out, "100MB"))


def route_torch_dcp_to_torch_save(ckpt: str, out: str) -> float:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    t0 = time.perf_counter()
    pt = Path(out, "full.pt")
    dcp_to_torch_save(ckpt, pt)
    state = torch.load(pt, weights_only=True)
    save_file(state, str(Path(out, "model.safetensors")))
    elapsed = time.perf_counter() - t0
    pt.unlink()
    return elapsed


def _empty_full() -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(t) for k, (t, _) in full_state().items()}


def route_torch_hf_writer_1proc(ckpt: str, out: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _empty_full()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(out), no_dist=True)
    return time.perf_counter() - t0


def _torch_hf_rank(rank: int, ckpt: str, out: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    state = {}
    for k, (t, dim) in full_state().items():
        if dim is None:
            state[k] = DTensor.from_local(torch.empty_like(t), mesh, [Replicate()])
        else:
            local = torch.empty_like(t.chunk(2, dim)[rank])
            state[k] = DTensor.from_local(local, mesh, [Shard(dim)])

    def work() -> None:
        dcp.load(state, checkpoint_id=ckpt)
        writer = HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
        dcp.save(state, storage_writer=writer)

    return _timed(rank, work)


def route_torch_hf_writer_2ranks(ckpt: str, out: str) -> float:
    return _from_ranks(on_two_ranks(_torch_hf_rank, ckpt, out))


def _live_rank(rank: int, who: str, out: str) -> float:
    """A trainer's live TP=2 DTensor state (built before the timer) written as one HF file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import shardsync

    mesh = init_device_mesh("cpu", (2,))
    state = {
        k: DTensor.from_local(t, mesh, [Replicate()])
        if dim is None
        else DTensor.from_local(t.chunk(2, dim)[rank].contiguous(), mesh, [Shard(dim)])
        for k, (t, dim) in full_state().items()
    }
    if who == "shardsync":
        return _timed(rank, lambda: shardsync.save_hf(state, out))
    writer = HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
    return _timed(rank, lambda: dcp.save(state, storage_writer=writer) and None)


def route_live_shardsync_2ranks(ckpt: str, out: str) -> float:
    return _from_ranks(on_two_ranks(_live_rank, "shardsync", out))


def route_live_torch_hf_writer_2ranks(ckpt: str, out: str) -> float:
    return _from_ranks(on_two_ranks(_live_rank, "torch", out))


def _loaded(ckpt: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = _empty_full()
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    return state


def _save_file(ckpt: str, out: str, fsync: bool) -> float:
    from safetensors.torch import save_file

    from shardsync.io.commit import fsync_path

    state = _loaded(ckpt)
    global _BEFORE
    _BEFORE = _rss("VmRSS")
    t0 = time.perf_counter()
    save_file(state, str(Path(out, "model.safetensors")))
    if fsync:  # what the crash-safe commit also pays
        fsync_path(Path(out, "model.safetensors"))
    return time.perf_counter() - t0


def route_save_file(ckpt: str, out: str) -> float:
    return _save_file(ckpt, out, fsync=False)


def route_save_file_fsync(ckpt: str, out: str) -> float:
    return _save_file(ckpt, out, fsync=True)


ROUTES: dict[str, Callable[[str, str], float]] = {
    "shardsync": route_shardsync,
    "shardsync_2ranks": route_shardsync_2ranks,
    "shardsync_2ranks_100mb": route_shardsync_2ranks_100mb,
    "shardsync_mapped": route_shardsync_mapped,
    "torch_dcp_to_torch_save": route_torch_dcp_to_torch_save,
    "torch_hf_writer_1proc": route_torch_hf_writer_1proc,
    "torch_hf_writer_2ranks": route_torch_hf_writer_2ranks,
    "save_file": route_save_file,
    "save_file_fsync": route_save_file_fsync,
    "live_shardsync_2ranks": route_live_shardsync_2ranks,
    "live_torch_hf_writer_2ranks": route_live_torch_hf_writer_2ranks,
}
TORCH_ROUTES = ("torch_dcp_to_torch_save", "torch_hf_writer_1proc", "torch_hf_writer_2ranks")
_BEFORE = 0
_PEAK: int | None = None
_RANK_MODULES: list[str] | None = None


def _from_ranks(ranks: list[dict[str, Any]]) -> float:
    """A two-rank route's time (rank 0's); its peak and the modules imported during it are its ranks'."""
    global _PEAK, _RANK_MODULES
    _PEAK = max(r["peak"] for r in ranks)
    _RANK_MODULES = sorted({m for r in ranks for m in r["new_modules"]})
    return float(ranks[0]["result"])


def child(route: str, ckpt: str, out: str) -> None:
    """Run one route and print ``{"seconds", "peak_bytes", "growth_bytes", "new_modules", "threads"}``
    as the last line (``new_modules``: those imported during the route's call)."""
    import warnings

    warnings.filterwarnings("ignore")
    preimport()
    global _BEFORE
    _BEFORE = _rss("VmRSS")
    before = set(sys.modules)
    seconds = ROUTES[route](ckpt, out)
    new = _RANK_MODULES if _RANK_MODULES is not None else sorted(set(sys.modules) - before)
    peak = _PEAK if _PEAK is not None else _rss("VmHWM")
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_bytes": peak,
                "growth_bytes": peak - _BEFORE,
                "new_modules": new,
                "threads": torch.get_num_threads(),
            }
        )
    )


# -- the parent ----------------------------------------------------------------------------------------


def _run(route: str, ckpt: Path, out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    run = subprocess.run(
        [sys.executable, __file__, "--route", route, str(ckpt), str(out)], check=True, capture_output=True, text=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def _cli(ckpt: Path, out: Path, *flags: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardsync", "convert", str(ckpt), str(out), "-q", *flags], check=True)
    return time.perf_counter() - t0


def _check(tmp: Path, ckpt: Path) -> None:
    """Every route writes the same tensors (compared with ``shardsync diff``'s comparison)."""
    from shardsync.cli.diff import DiffConfig, compare

    outs = {}
    for route in ("shardsync", "torch_dcp_to_torch_save", "torch_hf_writer_2ranks"):
        outs[route] = tmp / f"check_{route}"
        _run(route, ckpt, outs[route])
    for route, out in outs.items():
        if route != "shardsync":
            report = compare(DiffConfig(outs["shardsync"], out, progress=False))
            assert report.equal and len(report.tensors) == 3 + 6 * LAYERS, (route, report)
    assert compare(DiffConfig(ckpt, outs["shardsync"], progress=False)).equal
    for route in ("live_shardsync_2ranks", "live_torch_hf_writer_2ranks"):
        outs[route] = tmp / f"check_{route}"
        _run(route, ckpt, outs[route])
        assert compare(DiffConfig(outs["shardsync"], outs[route], progress=False)).equal, route


def _per_round(times: dict[str, list[float]], num: str, den: str) -> float:
    """The median of the per-round ratios ``num / den``."""
    return round(statistics.median(a / b for a, b in zip(times[num], times[den])), 2)


def measure(rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        tmp = Path(d)
        ckpt = tmp / "dcp_tp2"
        on_two_ranks(_write_tp2, str(ckpt))
        nbytes = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
        _check(tmp, ckpt)
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        peaks: dict[str, list[int]] = {r: [] for r in ROUTES}
        growth: dict[str, list[int]] = {r: [] for r in ROUTES}
        imported: dict[str, set[str]] = {r: set() for r in ROUTES}
        threads: set[int] = set()
        cli: dict[str, list[float]] = {"cli_nproc1": [], "cli_nproc2": []}
        for _ in range(rounds):
            for route in ROUTES:
                got = _run(route, ckpt, tmp / "out")
                times[route].append(got["seconds"])
                peaks[route].append(int(got["peak_bytes"]))
                growth[route].append(int(got["growth_bytes"]))
                imported[route].update(got["new_modules"])
                threads.add(got["threads"])
            cli["cli_nproc1"].append(_cli(ckpt, tmp / "out"))
            cli["cli_nproc2"].append(_cli(ckpt, tmp / "out", "--nproc", "2"))
    med = {r: statistics.median(v) for r, v in times.items()}
    fastest_torch = min(TORCH_ROUTES, key=med.__getitem__)  # of the DCP -> HF routes
    return {
        "checkpoint_bytes": nbytes,
        "rounds": rounds,
        "torch_threads_per_process": sorted(threads),
        "seconds": {r: round(v, 3) for r, v in med.items()},
        "range_seconds": {r: [round(min(v), 3), round(max(v), 3)] for r, v in times.items()},
        "gbps": {r: round(nbytes / v / 1e9, 3) for r, v in med.items()},
        "peak_rss_mb": {r: round(max(v) / 1e6) for r, v in peaks.items()},
        "rss_growth_mb": {r: round(max(v) / 1e6) for r, v in growth.items()},
        "imported_during_route": {r: sorted(v) for r, v in imported.items() if v},
        "cli_wall_seconds": {k: round(statistics.median(v), 2) for k, v in cli.items()},
        "fastest_torch_route": fastest_torch,
        "speedup_vs_fastest_torch": _per_round(times, fastest_torch, "shardsync"),
        "speedup_2ranks_vs_fastest_torch": _per_round(times, fastest_torch, "shardsync_2ranks"),
        "ratio_vs_save_file": _per_round(times, "shardsync", "save_file"),
        "ratio_vs_save_file_fsync": _per_round(times, "shardsync", "save_file_fsync"),
        "live_speedup_vs_torch_hf_writer": _per_round(times, "live_torch_hf_writer_2ranks", "live_shardsync_2ranks"),
    }


WINDOW = (
    "Timed window: the conversion alone (read the DCP checkpoint, write and commit the safetensors; "
    "2 ranks: between barriers, rank 0's time), every route with the same modules imported before it "
    "(bench_convert.IMPORTS); outside it: interpreter start, imports, a route's set-up (empty "
    "destination tensors for the torch routes; for save_file, loading the tensors)."
)


def markdown(runs: list[dict[str, Any]]) -> str:
    cols = [f"run {i + 1}: s (range) (GB/s) | peak RSS MB (growth)" for i in range(len(runs))]
    head = ["| route | " + " | ".join(cols) + " |", "|---|" + "---|---|" * len(runs)]
    rows = []
    for route in ROUTES:
        cells = []
        for r in runs:
            lo, hi = r["range_seconds"][route]
            cells.append(
                f"{r['seconds'][route]} ({lo}-{hi}) ({r['gbps'][route]}) | "
                f"{r['peak_rss_mb'][route]} ({r['rss_growth_mb'][route]})"
            )
        rows.append(f"| {route} | " + " | ".join(cells) + " |")
    lines = [
        f"TP=2 DCP checkpoint of {runs[0]['checkpoint_bytes'] / 1e9:.3f} GB (2 .distcp files) to HF "
        f"safetensors on disk; medians of {runs[0]['rounds']} interleaved rounds, torch's default threads "
        f"in every process ({', '.join(map(str, runs[0]['torch_threads_per_process']))}); ratios are "
        "medians of per-round ratios; peak RSS of the child process (2 ranks: the larger), growth = peak "
        "- RSS after imports.",
        "",
        WINDOW,
        "",
        *head,
        *rows,
        "",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"- run {i + 1} ({r['conditions']}): shardsync at {r['speedup_vs_fastest_torch']}x the "
            f"speed of the fastest torch route ({r['fastest_torch_route']}), 2 ranks "
            f"{r['speedup_2ranks_vs_fastest_torch']}x; {r['ratio_vs_save_file']}x the time of "
            f"save_file ({r['ratio_vs_save_file_fsync']}x with its fsync); live DTensor TP=2 -> HF on 2 "
            f"ranks at {r['live_speedup_vs_torch_hf_writer']}x the speed of torch's HuggingFaceStorageWriter"
        )
        for route, mods in r["imported_during_route"].items():
            lines.append(f"  - imported during {route} (its set-up or window): {', '.join(mods)}")
    for i, r in enumerate(runs):
        lines.append(
            f"- the command end to end (`python -m shardsync convert`, interpreter start and imports "
            f"included), run {i + 1}: {r['cli_wall_seconds']['cli_nproc1']} s, --nproc 2: "
            f"{r['cli_wall_seconds']['cli_nproc2']} s"
        )
    lines.append(
        "- goal (issue 17): >= 2x the speed of the fastest torch route, <= 1.5x the time of save_file + fsync; "
        "live DTensor -> HF >= 2x torch's HuggingFaceStorageWriter"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=int(os.environ.get("BENCH_RUNS", "2")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    a = ap.parse_args()
    runs = []
    with busy.busy_process() if a.busy else contextlib.nullcontext():
        for _ in range(a.runs):
            conditions = busy.conditions(a.busy)
            result = measure(a.rounds) | {"conditions": conditions}
            runs.append(result)
            print(json.dumps(result))
    name = busy.stem("convert", a.busy)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(runs, indent=2) + "\n")
    (a.out / f"{name}.md").write_text(markdown(runs))
    print(markdown(runs))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--route"]:
        child(*sys.argv[2:5])
    else:
        main()
