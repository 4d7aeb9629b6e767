"""Expert paging on a drifting Zipf(1.2) routing trace: hits and exposed stall.

64 experts, a device budget of 40% of all experts' bytes (25 slots), forward expert compute on
real tensors (this CPU), page transfers by the pager's copy workers throttled so that moving one
expert costs the same multiple of its compute time as on an A100 over PCIe Gen4:

    multiple M = (expert bytes / 26 GB/s) / (expert compute at the modelled tokens per expert)
               = (2 P / 26e9) / (T_e * 2 P / (312e12 * mfu))        (bf16 weights, P parameters)
               = 312e12 * mfu / (26e9 * T_e)                        (independent of P)

so with ``mfu`` 0.5 and ``T_e`` = 8,192 tokens per expert per step, M = 0.73. The CPU's own
expert compute time at the trace's average rows per expert (measured here) times M is then the
throttled transfer time of one expert.

Trace: Zipf(1.2) popularity over a permutation of the experts; the permutation drifts (every
step an adjacent pair of popularity ranks swaps with probability 0.2, and every 200 steps the
whole ranking rotates by 8 places: a hot set that moves). Each step routes ``--assignments``
token copies by a multinomial draw.

Variants, on the same trace in one run:
  pager       resident experts first, loads landing in between, soft prefetch + watermarks
  on-demand   no prefetch, no reordering: experts in id order, a fault waits for its load

Run: ``.venv/bin/python benchmarks/bench_paging.py`` (``--steps`` to shorten; ``--json`` for
machine-readable rows). Prints the load average beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetcomm.moe.paging import ExpertPager, PagingConfig  # noqa: E402

A100_BF16_FLOPS = 312e12
PCIE4_EFFECTIVE_BPS = 26e9


def transfer_multiple(tokens_per_expert: float, mfu: float) -> float:
    """M = transfer time / compute time of one expert on an A100 over PCIe Gen4 (see top)."""
    return A100_BF16_FLOPS * mfu / (PCIE4_EFFECTIVE_BPS * tokens_per_expert)


def drifting_zipf(num_experts: int, steps: int, s: float, g: torch.Generator):
    """Yield each step's ``[E]`` float64 popularity (see the module docstring), drawing the
    drift from ``g``; the caller draws the step's routing from ``g`` in between."""
    base = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    base /= base.sum()
    perm = torch.randperm(num_experts, generator=g)  # perm[r] = expert at popularity rank r
    for t in range(steps):
        if t and t % 200 == 0:
            perm = torch.roll(perm, 8)
        if float(torch.rand((), generator=g)) < 0.2:
            r = int(torch.randint(0, num_experts - 1, (), generator=g))
            perm[[r, r + 1]] = perm[[r + 1, r]]
        p = torch.empty(num_experts, dtype=torch.float64)
        p[perm] = base
        yield p


def drifting_zipf_trace(num_experts: int, steps: int, assignments: int, s: float, seed: int):
    """``[steps, E]`` int64 token copies per expert per step (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(steps, num_experts, dtype=torch.int64)
    for t, p in enumerate(drifting_zipf(num_experts, steps, s, g)):
        picks = torch.multinomial(p, assignments, replacement=True, generator=g)
        out[t] = torch.bincount(picks, minlength=num_experts)
    return out


def make_experts(E: int, D: int, F: int):
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(D, F), torch.nn.GELU(), torch.nn.Linear(F, D)) for _ in range(E)]


def measure_compute(expert, rows: int, D: int, reps: int = 30) -> float:
    x = torch.randn(rows, D)
    with torch.no_grad():
        for _ in range(3):
            expert(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            expert(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_variant(name: str, trace, experts, D: int, cfg: PagingConfig, warmup: int):
    x_all = torch.randn(int(trace.max()), D)
    strict = name == "on-demand"
    with ExpertPager(experts, cfg) as pager:
        step_times, stalls = [], []
        base = None
        for t in range(trace.shape[0]):
            if t == warmup:
                base = dict(pager.stats())
            counts = trace[t]
            t0 = time.perf_counter()
            order = pager.begin_step(counts)
            if strict:
                order = sorted(order)
            stall0 = pager.stats_total["stall_s"]
            with torch.no_grad():
                for g in pager.grants(order, strict=strict):
                    experts[g.expert](x_all[: int(counts[g.requested])])
                    pager.release(g.requested)
            pager.end_step()
            if t >= warmup:
                step_times.append(time.perf_counter() - t0)
                stalls.append(pager.stats_total["stall_s"] - stall0)
        st = pager.stats()
    d = {k: st[k] - base[k] for k in ("computations", "hits", "gate_hits", "waits", "loads", "prefetches", "evictions")}
    n = max(1, d["computations"])
    steps = len(step_times)
    return {
        "variant": name,
        "steps": steps,
        "computations": d["computations"],
        "hit_rate": d["hits"] / n,
        "gate_hit_rate": d["gate_hits"] / n,
        "exposed_stall_frac": sum(stalls) / sum(step_times),
        "median_step_ms": 1e3 * statistics.median(step_times),
        "loads_per_step": d["loads"] / steps,
        "prefetches_per_step": d["prefetches"] / steps,
        "experts_per_step": d["computations"] / steps,
        "num_slots": st["num_slots"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.4, help="device slots / experts")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--assignments", type=int, default=4096, help="token copies routed per step (CPU)")
    ap.add_argument("--model-dim", type=int, default=256)
    ap.add_argument("--hidden-dim", type=int, default=512)
    ap.add_argument("--tokens-per-expert", type=float, default=8192,
                    help="modelled A100 tokens per expert per step, which sets the transfer multiple")
    ap.add_argument("--mfu", type=float, default=0.5, help="modelled A100 model-flops utilisation")
    ap.add_argument("--variants", default="pager,on-demand")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # The CPU copy workers hand jobs to and from the compute thread; at Python's default 5 ms
    # switch interval each hand-off can cost a full interval (measured: 1,234 hand-offs, 6.5 s
    # of a 20 s run). On CUDA/NPU the copies are asynchronous on a side stream instead.
    sys.setswitchinterval(1e-4)
    E, D, F = args.experts, args.model_dim, args.hidden_dim
    experts = make_experts(E, D, F)
    M = transfer_multiple(args.tokens_per_expert, args.mfu)
    t_c = measure_compute(experts[0], args.assignments // E, D)
    probe = ExpertPager(experts[:1], PagingConfig(budget_fraction=1.0, training=False, optimizer_state_per_param=0))
    slot_bytes = probe.slot_bytes
    probe.close()
    rate = slot_bytes / (M * t_c)
    trace = drifting_zipf_trace(E, args.steps + args.warmup, args.assignments, 1.2, args.seed)
    load0 = os.getloadavg()[0]
    print(f"# bench_paging: E={E} budget={args.budget:.0%} D={D} F={F} assignments/step={args.assignments} "
          f"steps={args.steps} (+{args.warmup} warm-up)")
    print(f"# transfer multiple M={M:.2f} (A100 bf16 mfu {args.mfu}, {args.tokens_per_expert:.0f} tokens/expert, "
          f"PCIe Gen4 26 GB/s); CPU compute of one expert at {args.assignments // E} rows {t_c * 1e3:.2f} ms -> "
          f"transfer {M * t_c * 1e3:.2f} ms per {slot_bytes / 2**20:.2f} MiB expert")
    print(f"# load average at start {load0:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows = []
    for name in args.variants.split(","):
        cfg = PagingConfig(budget_fraction=args.budget, training=False, optimizer_state_per_param=0,
                           transfer_bytes_per_s=rate)
        if name == "on-demand":
            cfg = PagingConfig(budget_fraction=args.budget, training=False, optimizer_state_per_param=0,
                               transfer_bytes_per_s=rate, prefetch_min_free=1.0, evict_below_free=0.0)
        rows.append(run_variant(name, trace, experts, D, cfg, args.warmup))
    print("| variant | experts/step | started without waiting | resident at gate time | exposed stall / step time | "
          "median step ms | loads/step | prefetches/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['experts_per_step']:.1f} | {r['hit_rate']:.2%} | {r['gate_hit_rate']:.2%} | "
              f"{r['exposed_stall_frac']:.2%} | {r['median_step_ms']:.1f} | {r['loads_per_step']:.1f} | "
              f"{r['prefetches_per_step']:.2f} |")
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"multiple": M, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
