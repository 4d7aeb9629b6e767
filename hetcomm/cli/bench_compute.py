"""``hetcomm bench compute``: how fast this process's device multiplies — a GEMM and the expert FFN.

The compute table (``hetcomm.topo.compute``) holds datasheet peaks; placement and the step model
(``hetcomm.sched.step``) need what a device really reaches on MoE-sized work. This measures, on the
device the process would use (CUDA, NPU, else CPU):

* a square GEMM ``[N, N] @ [N, N]`` (``2 N^3`` FLOPs);
* the expert FFN forward + backward on ``T`` tokens: ``Linear(D, F) -> GELU -> Linear(F, D)``
  (``12 T D F`` FLOPs for the two GEMMs of each pass; the GELU is not counted);

each as the median of ``--iters`` timed runs after ``--warmup`` untimed ones, and reports
achieved TFLOPS next to the table's peak. Under ``torchrun`` every rank measures its own device
at the same time (what a job sees when all ranks compute) and rank 0 writes one row per rank to
``--output-file`` (JSON), the file :func:`load_measured_tflops` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any, Dict, List, Optional

__all__ = ["add_compute_args", "run_compute", "measure_gemm", "measure_expert_ffn", "load_measured_tflops", "pick_device"]


def add_compute_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``hetcomm bench compute`` (the collective flags do not apply to it)."""
    g = p.add_argument_group("compute (hetcomm bench compute)")
    g.add_argument("--gemm-n", type=int, default=1024, help="N of the square GEMM (default %(default)s)")
    g.add_argument("--tokens", type=int, default=2048, help="T tokens through the expert FFN (default %(default)s)")
    g.add_argument("--model-dim", type=int, default=512, help="D of the expert (default %(default)s)")
    g.add_argument("--hidden-dim", type=int, default=2048, help="F of the expert (default %(default)s)")
    g.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto", help="auto: bf16 on GPU/NPU, fp32 on CPU")


def pick_device() -> "Any":
    """The device this process computes on: the current CUDA / NPU device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _time(fn, device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dtype(name: str, device):
    import torch

    if name == "auto":
        name = "fp32" if device.type == "cpu" else "bf16"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def measure_gemm(n: int, *, device=None, dtype: str = "auto", iters: int = 5, warmup: int = 1) -> Dict[str, float]:
    """Median time and TFLOPS of ``[n, n] @ [n, n]`` on ``device`` (default :func:`pick_device`)."""
    import torch

    device = device or pick_device()
    dt = _dtype(dtype, device)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    t = _time(lambda: a @ b, device, iters, warmup)
    return {"time_s": t, "tflops": 2.0 * n**3 / t / 1e12}


def measure_expert_ffn(
    tokens: int, model_dim: int, hidden_dim: int, *, device=None, dtype: str = "auto", iters: int = 5, warmup: int = 1
) -> Dict[str, float]:
    """Median time and TFLOPS of one expert FFN forward + backward on ``[tokens, model_dim]``."""
    import torch

    device = device or pick_device()
    dt = _dtype(dtype, device)
    ffn = torch.nn.Sequential(
        torch.nn.Linear(model_dim, hidden_dim), torch.nn.GELU(), torch.nn.Linear(hidden_dim, model_dim)
    ).to(device=device, dtype=dt)
    x = torch.randn(tokens, model_dim, device=device, dtype=dt, requires_grad=True)
    g = torch.randn(tokens, model_dim, device=device, dtype=dt)

    def step():
        ffn.zero_grad(set_to_none=True)
        ffn(x).backward(g)

    t = _time(step, device, iters, warmup)
    return {"time_s": t, "tflops": 12.0 * tokens * model_dim * hidden_dim / t / 1e12}


def load_measured_tflops(path: str, kind: str = "expert_ffn") -> Dict[int, float]:
    """Rank -> measured TFLOPS (``gemm`` or ``expert_ffn``) from a ``bench compute`` JSON file."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return {int(row["rank"]): float(row[kind]["tflops"]) for row in doc["ranks"]}


def _measure(args: argparse.Namespace) -> Dict[str, Any]:
    from hetcomm.backends.rank_placement import local_device_kind
    from hetcomm.topo.compute import find_device_spec

    device = pick_device()
    vendor, model = local_device_kind()
    if vendor == "cpu":
        model = "cpu"
    spec = find_device_spec(model)
    gemm = measure_gemm(args.gemm_n, device=device, dtype=args.dtype, iters=args.iters, warmup=args.warmup_iters)
    ffn = measure_expert_ffn(
        args.tokens, args.model_dim, args.hidden_dim, device=device, dtype=args.dtype, iters=args.iters, warmup=args.warmup_iters
    )
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "model": model,
        "table_tflops": spec.tflops if spec is not None else None,
        "gemm": gemm,
        "expert_ffn": ffn,
    }


def run_compute(args: argparse.Namespace) -> int:
    """``hetcomm bench compute``: measure, gather per rank (under torchrun), print, write JSON."""
    import torch
    import torch.distributed as dist

    joined = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if joined:
        dist.init_process_group("gloo")
    try:
        row = _measure(args)
        rank = dist.get_rank() if joined else 0
        row["rank"] = rank
        rows: List[Optional[Dict[str, Any]]] = [None] * (dist.get_world_size() if joined else 1)
        if joined:
            dist.all_gather_object(rows, row)
        else:
            rows = [row]
        if rank != 0:
            return 0
        doc = {
            "schema": "hetcomm.bench.compute/1",
            "config": {
                "gemm_n": args.gemm_n, "tokens": args.tokens, "model_dim": args.model_dim,
                "hidden_dim": args.hidden_dim, "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup_iters,
            },
            "ranks": rows,
        }
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            print(f"# hetcomm bench compute: GEMM {args.gemm_n}^3, expert FFN T={args.tokens} D={args.model_dim} "
                  f"F={args.hidden_dim} fwd+bwd, dtype {args.dtype}, median of {args.iters}")
            print(f"{'rank':>4}  {'host':<16} {'device':<8} {'model':<16} {'GEMM TFLOPS':>11} {'FFN TFLOPS':>10} {'table':>8}")
            for r in rows:
                assert r is not None
                table = f"{r['table_tflops']:.0f}" if r["table_tflops"] else "-"
                print(f"{r['rank']:>4}  {r['host'][:16]:<16} {r['device']:<8} {r['model'][:16]:<16} "
                      f"{r['gemm']['tflops']:>11.4f} {r['expert_ffn']['tflops']:>10.4f} {table:>8}")
        if args.output_file:
            from hetcomm.cli._bench_output import open_output, write_output

            out = open_output(args.output_file)
            assert out is not None
            write_output(out, doc)  # a full disk: one -J/--output_file line and exit 2
        return 0
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()
