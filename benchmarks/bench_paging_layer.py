"""The paged MoELayer in training: hits, exposed stall and step time against the unpaged layer.

One process, one ``MoELayer`` (``E`` experts, top-2, dropless, no calibration), AdamW, forward +
backward + optimizer step per step. Routing follows the drifting Zipf(1.2) popularity of
``benchmarks/bench_paging.py`` (same trace generator): the gate is set so that each token's
top-2 experts are the two drawn for it (token ``= 4 * onehot(first) + 3 * onehot(second)`` plus
noise, gate weight ``= identity`` on the first ``E`` dims), so the layer's own gate, dispatch,
pager and experts run on a routing trace we control.

Page transfers are throttled as in bench_paging: moving one expert costs ``M`` times its
forward compute at the trace's average rows per expert, ``M`` from an A100 over PCIe Gen4
(26 GB/s) at ``--tokens-per-expert`` modelled tokens. Training moves more than inference: a
slot holds the expert's weights and Adam's two moments, every eviction writes back, and a step
whose routed experts exceed the slots streams them in waves (backward reloads them).

Variants, on the same trace and the same initial weights, in one run (``--runs`` times each,
interleaved; medians of the runs, and the median of each run's ratio to the unpaged run):
  unpaged     every expert resident (the reference step time)
  paged B     page_budget B for each B of --budgets

Run: ``.venv/bin/python benchmarks/bench_paging_layer.py`` (``--steps`` to shorten). Prints the
load average beside the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_paging import drifting_zipf, measure_compute, transfer_multiple  # noqa: E402

from hetcomm.moe import MoELayer  # noqa: E402
from hetcomm.moe.paging import ExpertPager, PagingConfig  # noqa: E402


def token_batches(E: int, D: int, steps: int, tokens: int, s: float, seed: int):
    """``steps`` inputs ``[tokens, D]`` whose top-2 under an identity gate follow the drifting
    Zipf popularity (first and second choice drawn without repeat)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in drifting_zipf(E, steps, s, g):
        first = torch.multinomial(p, tokens, replacement=True, generator=g)
        p2 = p.expand(tokens, E).clone()
        p2[torch.arange(tokens), first] = 0.0
        second = torch.multinomial(p2, 1, generator=g).squeeze(1)
        x = 0.1 * torch.randn(tokens, D, generator=g)
        x[torch.arange(tokens), first] += 4.0
        x[torch.arange(tokens), second] += 3.0
        out.append(x)
    return out


def make_layer(E: int, D: int, F: int, budget: float, rate: float) -> MoELayer:
    def expert(dim: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(dim, F), torch.nn.GELU(), torch.nn.Linear(F, dim))

    layer = MoELayer(D, E, k=2, dropless=True, calibrate=False, expert=expert, seed=0, page_budget=budget,
                     paging=PagingConfig(transfer_bytes_per_s=rate))
    with torch.no_grad():
        layer.gate.wg.weight.zero_()
        layer.gate.wg.weight[:, :E] = torch.eye(E)
    layer.gate.wg.weight.requires_grad_(False)  # keep the routing on the trace
    return layer


def run_variant(name: str, layer: MoELayer, batches, warmup: int):
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=1e-3)
    layer.attach_optimizer(opt)
    step_s, stall_s, hits, faults, waves, used = [], [], 0, 0, 0, []
    for t, x in enumerate(batches):
        t0 = time.perf_counter()
        layer(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        layer.end_page_step()
        dt = time.perf_counter() - t0
        st = layer.step_stats()
        if t >= warmup:
            step_s.append(dt)
            if layer.pager is not None:
                stall_s.append(st["page_stall_s"])
                hits += st["page_hits"]
                faults += st["page_faults"]
                waves += int(st["page_waves"])
                used.append(st["page_experts_used"])
    if layer.pager is not None:
        layer.pager.close()
    n = max(1, hits + faults)
    return {
        "variant": name,
        "median_step_ms": 1e3 * statistics.median(step_s),
        "hit_rate": hits / n if layer.pager is not None else None,
        "stall_frac": sum(stall_s) / sum(step_s) if layer.pager is not None else None,
        "wave_steps": waves / len(step_s) if layer.pager is not None else None,
        "experts_used": statistics.mean(used) if used else None,
        "slots": layer.pager.num_slots if layer.pager is not None else layer.config.num_experts,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--budgets", default="0.4,0.7", help="comma-separated page budgets to compare")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per step (x2 copies)")
    ap.add_argument("--model-dim", type=int, default=256)
    ap.add_argument("--hidden-dim", type=int, default=512)
    ap.add_argument("--tokens-per-expert", type=float, default=8192)
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3, help="runs of every variant, interleaved; medians reported")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-4)  # copy-worker hand-offs (see bench_paging)
    E, D, F = args.experts, args.model_dim, args.hidden_dim
    if D < E:
        ap.error("--model-dim must be >= --experts (the identity gate)")
    M = transfer_multiple(args.tokens_per_expert, args.mfu)
    probe_layer = make_layer(E, D, F, 0.0, 1.0)
    t_c = measure_compute(probe_layer.experts.experts[0], max(1, 2 * args.tokens // E), D)
    probe = ExpertPager([probe_layer.experts.experts[0]], PagingConfig(budget_fraction=1.0))
    slot_bytes = probe.slot_bytes  # weights + Adam's two moments
    probe.close()
    rate = slot_bytes / (M * t_c)
    batches = token_batches(E, D, args.steps + args.warmup, args.tokens, 1.2, args.seed)
    print(f"# bench_paging_layer: E={E} D={D} F={F} tokens/step={args.tokens} (k=2) steps={args.steps} "
          f"(+{args.warmup} warm-up), training (forward+backward+AdamW)")
    print(f"# transfer multiple M={M:.2f}; CPU forward of one expert at {max(1, 2 * args.tokens // E)} rows "
          f"{t_c * 1e3:.3f} ms -> {M * t_c * 1e3:.3f} ms per {slot_bytes / 2**20:.2f} MiB slot (weights + Adam)")
    print(f"# load average at start {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    budgets = [0.0] + [float(b) for b in args.budgets.split(",")]
    runs: List[List[dict]] = [[] for _ in budgets]
    for _ in range(args.runs):  # interleaved, so load changes hit every variant alike
        for i, b in enumerate(budgets):
            runs[i].append(run_variant("unpaged" if b == 0 else f"paged {b:g}", make_layer(E, D, F, b, rate),
                                       batches, args.warmup))
    rows = []
    for per in runs:
        r = dict(per[0])
        for key in ("median_step_ms", "hit_rate", "stall_frac"):
            if r[key] is not None:
                r[key] = statistics.median(x[key] for x in per)
        r["ratio"] = statistics.median(x["median_step_ms"] / u["median_step_ms"] for x, u in zip(per, runs[0]))
        rows.append(r)
    print("| variant | slots | experts used/step | steps in waves | started without waiting | exposed stall / step time "
          "| median step ms | vs unpaged |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def pct(v):
            return "-" if v is None else f"{v:.2%}"
        used = "-" if r["experts_used"] is None else f"{r['experts_used']:.1f}"
        print(f"| {r['variant']} | {r['slots']} | {used} | {pct(r['wave_steps'])} | {pct(r['hit_rate'])} | "
              f"{pct(r['stall_frac'])} | {r['median_step_ms']:.1f} | {r['ratio']:.2f}x |")
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
