"""hetcomm's MoELayer against DeepSpeed-MoE, with the expert-math floor, in one run.

Four rank processes (one torch thread each) run, in turns inside every round, so that machine
noise hits every variant alike:

    deepspeed   deepspeed.moe.layer.MoE(hidden_size=D, expert=Linear(D,F)+GELU+Linear(F,D),
                num_experts=E, ep_size=4, k=2, capacity_factor=1.25) over gloo (the default group)
    hetcomm     hetcomm.moe.MoELayer with the same E, k, capacity factor and expert module, over a
                ``new_group(backend="hetcomm")``; FP32 wire, no replication, no calibration
                (DeepSpeed has neither); every other option at its default
    floor x4    the expert math alone: each of the same 4 processes runs its experts'
                Linear+GELU+Linear forward+backward on exactly 4,096 x k = 8,192 rows spread
                evenly over its E/4 experts (no routing, no padding, no communication), all 4 at
                once
    floor x2    the same work on 2 processes at once (one per core; the other 2 wait at a
                barrier), converted to what 4 ranks sharing 2 cores can get: 4096 / (2 * t)

With ``--zipf`` each configuration also runs, under Zipf(1.2)-skewed routing, DeepSpeed,
hetcomm without and hetcomm with hot-expert replication (top 3 experts on every rank).

Every step is forward + backward of ``mean(y^2) + 0.01 * l_aux`` on 4,096 tokens of width D per
rank (input requires grad), timed from a barrier to the end of backward on each rank; the step
time is the slowest rank's. After every step (untimed) an SGD step with lr=0 bumps the weights'
versions without changing them: replication then pays its per-step replica refresh as it would
in training, while routing stays stationary. Reported: median over the timed steps, tokens/s per
rank = 4096 / median step time, and the ratios.

    .venv-bench/bin/python benchmarks/moe_vs_deepspeed.py --config all --zipf
    .venv-bench/bin/python benchmarks/moe_vs_deepspeed.py --config fine --steps 3 --tokens 1024

Needs deepspeed (``.venv-bench``: torch 2.13.0 + deepspeed 0.19.8 + hetcomm editable); runs on CPU
with ``DS_ACCELERATOR=cpu``. All ranks are CPU processes on one host: no device kind is
emulated, the transports (hetcomm's shm rail, gloo) are real.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

WORLD_SIZE = 4
K = 2
CAPACITY_FACTOR = 1.25
ZIPF_S = 1.2


@dataclass(frozen=True)
class BenchConfig:
    """One layer shape.

    Attributes:
        name: ``coarse`` or ``fine``.
        num_experts: ``E`` global experts (``E / 4`` per rank).
        model_dim: ``D``.
        hidden_dim: ``F``, the expert FFN's hidden width.
        min_vs_deepspeed: target ratio hetcomm / DeepSpeed (issue 5, item 7).
        min_vs_floor: target ratio hetcomm / floor.
    """

    name: str
    num_experts: int
    model_dim: int
    hidden_dim: int
    min_vs_deepspeed: float
    min_vs_floor: float


CONFIGS = {
    "coarse": BenchConfig("coarse", 8, 512, 2048, 1.0, 0.9),
    "fine": BenchConfig("fine", 64, 1024, 256, 1.6, 0.8),
}


# -- routing skew --------------------------------------------------------------------------------
def zipf_probs(num_experts: int, s: float = ZIPF_S):
    """``[E]`` float64 Zipf(s) probabilities ``p_e ~ (e + 1)^-s``."""
    import torch

    p = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    return p / p.sum()


def zipf_gate_weight(num_experts: int, model_dim: int):
    """``[E, D]`` float32 gate weight that turns :func:`zipf_input` into Zipf routing.

    With input feature 0 constant 1 and features ``1..E`` i.i.d. Gumbel(0, 1), this weight makes
    the logits ``log p_e + g_e``: by the Gumbel-max trick the first choice is exactly
    Zipf(1.2)-distributed and the second a draw without replacement from the rest (Plackett-Luce).
    The gate has no bias, so the constant feature carries the bias ``log p_e``.
    """
    import torch

    if model_dim < num_experts + 1:
        raise ValueError(f"Zipf routing needs model_dim >= num_experts + 1, got D={model_dim}, E={num_experts}")
    w = torch.zeros(num_experts, model_dim)
    w[:, 0] = torch.log(zipf_probs(num_experts)).float()
    w[:, 1 : 1 + num_experts] = torch.eye(num_experts)
    return w


def zipf_input(num_tokens: int, num_experts: int, model_dim: int, generator):
    """``[T, D]`` float32 tokens: N(0, 1) features, feature 0 = 1, features ``1..E`` Gumbel."""
    import torch

    x = torch.randn(num_tokens, model_dim, generator=generator)
    x[:, 0] = 1.0
    u = torch.rand(num_tokens, num_experts, generator=generator).clamp(1e-9, 1 - 1e-9)
    x[:, 1 : 1 + num_experts] = -torch.log(-torch.log(u))
    return x


# -- rank side -----------------------------------------------------------------------------------
def _expert(model_dim: int, hidden_dim: int):
    from torch import nn

    return nn.Sequential(nn.Linear(model_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, model_dim))


class _Variant:
    """One timed thing: ``step()`` runs forward + backward once and returns extra stats."""

    def __init__(self, name: str, kind: str, step: Callable[[], Dict[str, Any]], params=None, timed_ranks=None):
        self.name = name
        self.kind = kind  # deepspeed | hetcomm | floor
        self.step = step
        self.params = list(params or [])
        self.timed_ranks = timed_ranks  # None: all ranks work


def _build_variants(cfg: BenchConfig, args, rank: int, hgroup) -> List[_Variant]:
    import torch
    from deepspeed.moe.layer import MoE

    from hetcomm.moe import MoELayer

    E, D, F, T = cfg.num_experts, cfg.model_dim, cfg.hidden_dim, args.tokens
    L = E // WORLD_SIZE
    g = torch.Generator().manual_seed(1000 + rank)
    x_plain = torch.randn(T, D, generator=g)
    x_zipf = zipf_input(T, E, D, g) if args.zipf else None

    def loss_of(y, l_aux):
        return y.float().square().mean() + 0.01 * l_aux

    out: List[_Variant] = []

    def add_deepspeed(name: str, x, zipf: bool) -> None:
        torch.manual_seed(7)
        moe = MoE(hidden_size=D, expert=_expert(D, F), num_experts=E, ep_size=WORLD_SIZE, k=K,
                  capacity_factor=CAPACITY_FACTOR)
        moe.set_deepspeed_parallelism()
        if zipf:
            with torch.no_grad():
                moe.deepspeed_moe.gate.wg.weight.copy_(zipf_gate_weight(E, D))

        def step() -> Dict[str, Any]:
            xi = x.clone().requires_grad_(True)
            y, l_aux, exp_counts = moe(xi)
            loss_of(y, l_aux).backward()
            return {}

        out.append(_Variant(name, "deepspeed", step, moe.parameters()))

    def add_hetcomm(name: str, x, zipf: bool, **options) -> None:
        layer = MoELayer(D, E, k=K, capacity_factor=CAPACITY_FACTOR, expert=_expert(D, F), group=hgroup,
                         wire_dtype="fp32", calibrate=False, **options)
        if zipf:
            with torch.no_grad():
                layer.gate.wg.weight.copy_(zipf_gate_weight(E, D))

        def step() -> Dict[str, Any]:
            xi = x.clone().requires_grad_(True)
            y = layer(xi)
            loss_of(y, layer.l_aux).backward()
            st = layer.step_stats()
            return {
                "overflow_rate": st["overflow_rate"],
                "local_fraction": st["local_fraction"],
                "a2a_bytes_sent": st["a2a_bytes_sent"],
                "comm_exposed_s": st["comm_exposed_s"],
                "expert_s": st["expert_s"],
                "forward_s": st["forward_s"],
                "rows": sum(st["rows_per_expert"]),
                "replicas": len(st["replicas"]),
            }

        out.append(_Variant(name, "hetcomm", step, layer.parameters()))

    def add_floor(name: str, workers: int) -> None:
        torch.manual_seed(11)
        mods = [_expert(D, F) for _ in range(L)]
        rows = [(T * K) // L + (1 if i < (T * K) % L else 0) for i in range(L)]
        xs = [torch.randn(n, D) for n in rows]

        def step() -> Dict[str, Any]:
            if rank >= workers:
                return {}
            for m, xx in zip(mods, xs):
                xi = xx.clone().requires_grad_(True)
                m(xi).square().mean().backward()
            return {}

        params = [p for m in mods for p in m.parameters()]
        out.append(_Variant(name, "floor", step, params, timed_ranks=workers))

    add_deepspeed("deepspeed", x_plain, False)
    add_hetcomm("hetcomm", x_plain, False)
    add_floor("floor x4", 4)
    add_floor("floor x2", 2)
    if args.zipf:
        add_deepspeed("deepspeed zipf", x_zipf, True)
        add_hetcomm("hetcomm zipf", x_zipf, True)
        # Hot set re-chosen every step from the EMA (it settles after the warm-up and then stays;
        # only a change of the set moves weights); replicas on every rank (no cluster file:
        # all ranks count as strong).
        add_hetcomm("hetcomm zipf +rep", x_zipf, True, replicate=True, replicate_every=1)
    return out


def _rank_main(rank: int, port: int, args, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    # One torch thread per rank: 4 ranks on 2 cores already oversubscribe the machine.
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist

    import hetcomm  # noqa: F401  (registers the backend)

    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timeout)
    hgroup = dist.new_group(backend="hetcomm", timeout=timeout)

    results: Dict[str, Any] = {}
    for cfg_name in args.configs:
        cfg = CONFIGS[cfg_name]
        variants = _build_variants(cfg, args, rank, hgroup)
        opts = [torch.optim.SGD(v.params, lr=0.0) if v.params else None for v in variants]
        times: Dict[str, List[float]] = {v.name: [] for v in variants}
        extra: Dict[str, List[Dict[str, Any]]] = {v.name: [] for v in variants}
        rounds = args.warmup + args.steps
        for rnd in range(rounds):
            # Rotate the order every round: no variant always runs right after the heaviest one.
            n = len(variants)
            order = [(i + rnd) % n for i in range(n)]
            for i in order:
                v, opt = variants[i], opts[i]
                dist.barrier()
                t0 = time.perf_counter()
                st = v.step()
                dt = time.perf_counter() - t0
                slow = torch.tensor([dt if (v.timed_ranks is None or rank < v.timed_ranks) else 0.0])
                dist.all_reduce(slow, op=dist.ReduceOp.MAX)
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if rnd >= args.warmup:
                    times[v.name].append(float(slow))
                    extra[v.name].append(st)
            if rank == 0:
                done = {v.name: times[v.name][-1] for v in variants} if rnd >= args.warmup else {}
                msg = " ".join(f"{k}={1e3 * t:.0f}ms" for k, t in done.items())
                print(f"[{cfg.name}] round {rnd + 1}/{rounds}{' (warm-up)' if rnd < args.warmup else ''} {msg}",
                      file=sys.stderr, flush=True)
        results[cfg.name] = {"times": times, "extra": extra}
        del variants, opts
    q.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


# -- parent side ---------------------------------------------------------------------------------
def machine_info() -> Dict[str, Any]:
    """nproc, CPU model, load averages, date: the facts every table carries."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": model,
        "host": platform.node(),
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "loadavg": os.getloadavg(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(args) -> Optional[Dict[int, Any]]:
    """Spawn the 4 ranks, wait for their results; None if a rank failed or timed out."""
    import torch.multiprocessing as mp

    # Inherited by the spawned ranks: DeepSpeed on CPU, one OpenMP/MKL thread, no cluster file
    # (hetcomm then treats all 4 ranks as equal, like DeepSpeed's ep_size=4).
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    os.environ.pop("HETCOMM_CLUSTER", None)
    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, q), daemon=True) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + args.timeout
    failed = None
    try:
        while len(results) < WORLD_SIZE:
            if time.monotonic() > deadline:
                missing = sorted(set(range(WORLD_SIZE)) - set(results))
                failed = f"timed out after {args.timeout:.0f} s waiting for rank(s) {missing} (--timeout)"
                break
            try:
                rank, res = q.get(timeout=2)
                results[rank] = res
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    failed = f"rank(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]}; see the traceback above"
                    break
    finally:
        for p in procs:
            p.join(timeout=30 if failed is None else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failed:
        print(f"moe_vs_deepspeed: {failed}", file=sys.stderr)
        return None
    return results


def summarize(results: Dict[int, Any], args) -> Dict[str, Any]:
    """Medians per configuration and variant, ratios and targets."""
    med = statistics.median
    T = args.tokens
    summary: Dict[str, Any] = {}
    for cfg_name in args.configs:
        cfg = CONFIGS[cfg_name]
        times = results[0][cfg_name]["times"]
        rows: Dict[str, Dict[str, Any]] = {}
        for name, ts in times.items():
            t = med(ts)
            # Floor x2: 2 processes each did a rank's work on a core of their own; 4 ranks
            # sharing the 2 cores get half of that each.
            scale = 2.0 if name == "floor x2" else 1.0
            row = {"step_s": t * scale, "tokens_per_s": T / (t * scale), "steps": ts, "spread": (min(ts), max(ts))}
            ex = [e for r in range(WORLD_SIZE) for e in results[r][cfg_name]["extra"][name] if e]
            for key in ("overflow_rate", "local_fraction", "a2a_bytes_sent", "comm_exposed_s", "expert_s", "forward_s"):
                vals = [e[key] for e in ex if key in e]
                if vals:
                    row[key] = med(vals)
            rows[name] = row
        ds = rows["deepspeed"]["tokens_per_s"]
        floor = rows["floor x4"]["tokens_per_s"]
        for row in rows.values():
            row["vs_deepspeed"] = row["tokens_per_s"] / ds
            row["vs_floor"] = row["tokens_per_s"] / floor
        if "deepspeed zipf" in rows:
            dsz = rows["deepspeed zipf"]["tokens_per_s"]
            for name in ("deepspeed zipf", "hetcomm zipf", "hetcomm zipf +rep"):
                rows[name]["vs_deepspeed"] = rows[name]["tokens_per_s"] / dsz
        het = rows["hetcomm"]
        summary[cfg_name] = {
            "config": asdict(cfg),
            "rows": rows,
            "target_vs_deepspeed_met": het["vs_deepspeed"] >= cfg.min_vs_deepspeed,
            "target_vs_floor_met": het["vs_floor"] >= cfg.min_vs_floor,
        }
    return summary


def render(summary: Dict[str, Any], args, before: Dict[str, Any], after: Dict[str, Any], versions: Dict[str, str]) -> str:
    """The markdown tables."""
    lines = []
    la0 = " / ".join(f"{x:.1f}" for x in before["loadavg"])
    la1 = " / ".join(f"{x:.1f}" for x in after["loadavg"])
    lines.append(
        f"Machine: {before['host']}, {before['nproc']} CPUs ({before['cpu']}), {before['date']} UTC; "
        f"load average (1/5/15 min) {la0} before, {la1} after. torch {versions['torch']}, "
        f"deepspeed {versions['deepspeed']}, hetcomm {versions['hetcomm']}. 4 ranks x 1 thread, "
        f"{args.tokens} tokens/rank, k={K}, capacity factor {CAPACITY_FACTOR}, forward+backward, "
        f"median of {args.steps} timed rounds after {args.warmup} warm-up."
    )
    for cfg_name, s in summary.items():
        c = s["config"]
        lines.append("")
        lines.append(
            f"**{cfg_name}** E={c['num_experts']} D={c['model_dim']} F={c['hidden_dim']} "
            f"(targets: >= {c['min_vs_deepspeed']}x DeepSpeed, >= {c['min_vs_floor']}x floor)"
        )
        lines.append("")
        lines.append("| variant | step ms (median) | min..max ms | tokens/s per rank | vs DeepSpeed | vs floor | dropped | local |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for name, r in s["rows"].items():
            scale = 2.0 if name == "floor x2" else 1.0
            lo, hi = (x * scale for x in r["spread"])
            drop = f"{r['overflow_rate']:.1%}" if "overflow_rate" in r else ""
            loc = f"{r['local_fraction']:.2f}" if "local_fraction" in r else ""
            lines.append(
                f"| {name} | {r['step_s'] * 1e3:.0f} | {lo * 1e3:.0f}..{hi * 1e3:.0f} | {r['tokens_per_s']:.0f} | "
                f"{r['vs_deepspeed']:.2f}x | {r['vs_floor']:.2f}x | {drop} | {loc} |"
            )
        het = s["rows"]["hetcomm"]
        lines.append("")
        lines.append(
            f"hetcomm / DeepSpeed = {het['vs_deepspeed']:.2f}x ({'met' if s['target_vs_deepspeed_met'] else 'MISSED'}), "
            f"hetcomm / floor x4 = {het['vs_floor']:.2f}x ({'met' if s['target_vs_floor_met'] else 'MISSED'})."
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["coarse", "fine", "all"], default="all")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds, every variant once per round (>= 5 for a table)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (4096 for the table)")
    ap.add_argument("--zipf", action="store_true", help="add the Zipf(1.2)-routed variants, replication on and off")
    ap.add_argument("--json", metavar="PATH", help="also write every timing and the summary as JSON")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is given up")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.tokens < 1:
        ap.error("--steps must be >= 1, --warmup >= 0, --tokens >= 1")
    args.configs = ["coarse", "fine"] if args.config == "all" else [args.config]
    try:
        import deepspeed  # noqa: F401  (fail here, with advice, not inside 4 ranks)
    except ImportError as e:
        print(f"moe_vs_deepspeed: deepspeed is not importable ({e}); run this with the benchmark venv: "
              f".venv-bench/bin/python (see benchmarks/README.md)", file=sys.stderr)
        return 2
    import torch

    import hetcomm

    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "hetcomm": hetcomm.__version__}
    before = machine_info()
    t0 = time.monotonic()
    results = run_group(args)
    if results is None:
        return 1
    after = machine_info()
    summary = summarize(results, args)
    print(render(summary, args, before, after, versions))
    print(f"\n({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_before": before, "machine_after": after, "versions": versions,
                       "args": {k: v for k, v in vars(args).items()}, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
