"""Expert balancer vs static placement vs EPLB, on Zipf(1.2) routing whose hot set moves.

4 ranks, 64 experts, top-2 routing from Zipf(1.2) gate logits (``log p_e`` + Gumbel noise, the
construction of ``zipf_routing.py``: the first choice is exactly Zipf(1.2)); every 500 steps
the popularity order is redrawn (a new hot set). Each step ``--sample-tokens`` tokens are drawn
and their top-2 counts scaled to ``--tokens`` tokens per step (the modelled batch); the gate
logits of the sampled tokens feed the balancer's fast timescale.

Per step and placement: rank ``r``'s tokens ``L_r`` (an expert with copies splits its tokens
evenly over them, as both EPLB's and hetcomm's dispatch pick a copy uniformly), modelled step time ``max_r L_r * flops_per_token / (speed_r * 1e12 * mfu)`` plus the
transfer time of every expert copy a placement moved at that step (charged in full, for EPLB and
for hetcomm alike; EPLB ignores the cost, hetcomm weighs it). Expert: DeepSeek-V2-Lite's
routed FFN (D=2048, F=1408), forward+backward 6 * 3 * D * F FLOPs per token, moved with its
bf16 weights, fp32 master copy and Adam state (14 bytes per parameter) at 25 GB/s.

Placements:
  static   experts dealt contiguously, 16 per rank, never moved
  EPLB     DeepSeek's EPLB (github.com/deepseek-ai/EPLB, eplb.py: rebalance_experts; global
           policy, since 4 ranks on 3 nodes do not divide into equal node groups): replicas by
           largest per-copy load, then balanced packing with an equal number of physical experts
           per GPU; re-run every 50 steps on the last 100 steps' loads (no cost, no cooldown).
           Implemented below from the published algorithm (not copied).
  hetcomm  hetcomm.moe.balancer.ExpertBalancer: two timescales, capacity-aware, gain > cost,
           1,000-step cooldown; the same number of redundant copies as EPLB.

Clusters (speeds = dense TFLOPS from ``hetcomm.topo.compute.rank_speeds``):
  mixed     configs/clusters/mixed-mini.yaml             (A100, A100, H800, 910B)
  half      configs/clusters/mixed-mini-halfspeed.yaml   (100, 100, 100, 50: 910B at half speed)
  equal     four ranks of 312

Run: ``.venv/bin/python benchmarks/bench_balancer.py`` (``--steps 3000`` default; ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetcomm.moe.placement.balancer import (  # noqa: E402
    BalancerConfig,
    ExpertBalancer,
    ExpertMap,
    diff_maps,
    fast_signal,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D_MODEL, F_EXPERT = 2048, 1408
FLOPS_PER_TOKEN = 6 * 3 * D_MODEL * F_EXPERT
BYTES_PER_EXPERT = 3 * D_MODEL * F_EXPERT * 14
LINK_BPS = 25e9


# -- EPLB (after DeepSeek's eplb.py; own implementation of the published algorithm) ----------


def eplb_balanced_packing(weight: Sequence[float], num_packs: int) -> List[int]:
    """Items sorted by weight, each to the lightest pack that still has room; every pack gets
    exactly ``n / num_packs`` items. Returns the pack of each item."""
    n = len(weight)
    assert n % num_packs == 0
    per = n // num_packs
    pack_w = [0.0] * num_packs
    pack_n = [0] * num_packs
    out = [-1] * n
    for i in sorted(range(n), key=lambda i: -weight[i]):
        p = min((p for p in range(num_packs) if pack_n[p] < per), key=lambda p: pack_w[p])
        out[i] = p
        pack_w[p] += weight[i]
        pack_n[p] += 1
    return out


def eplb_replicate(weight: Sequence[float], num_phy: int):
    """Physical experts: the logical ones, then each redundant copy to the expert with the
    largest ``weight / copies``. Returns (phy2log, copies per logical expert)."""
    cnt = [1] * len(weight)
    phy2log = list(range(len(weight)))
    for _ in range(len(weight), num_phy):
        e = max(range(len(weight)), key=lambda e: weight[e] / cnt[e])
        phy2log.append(e)
        cnt[e] += 1
    return phy2log, cnt


def eplb_rebalance(weight: Sequence[float], num_phy: int, num_gpus: int) -> ExpertMap:
    """EPLB's global policy for one layer: replicate, then pack physical experts onto GPUs
    (equal count per GPU) by their per-copy load. Copies of one expert may share a GPU in EPLB;
    here they are folded into one copy on that GPU (the same tokens, the same load)."""
    phy2log, cnt = eplb_replicate(weight, num_phy)
    phy_w = [weight[e] / cnt[e] for e in phy2log]
    pack = eplb_balanced_packing(phy_w, num_gpus)
    ranks: List[List[int]] = [[] for _ in weight]
    for p, e in enumerate(phy2log):
        if pack[p] not in ranks[e]:
            ranks[e].append(pack[p])
    return ExpertMap.from_lists(ranks, num_gpus)


# -- trace --------------------------------------------------------------------------------------


def make_trace(E: int, steps: int, sample_tokens: int, tokens: int, phase: int, seed: int, biases: bool = False):
    """(counts [S, E] float64 scaled to ``tokens`` top-2 picks per step, fast [S, E]), and with
    ``biases`` also the gate bias of each phase (``[S // phase]`` lists of ``E`` floats: a
    token's logits are ``bias + Gumbel noise``, so a benchmark can draw more tokens of any step)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.arange(1, E + 1, dtype=torch.float64) ** -1.2)
    counts = torch.zeros(steps, E, dtype=torch.float64)
    fast = torch.zeros(steps, E, dtype=torch.float64)
    perm = torch.randperm(E, generator=g)
    phase_bias: List[List[float]] = []
    for t in range(steps):
        if t % phase == 0:
            perm = torch.randperm(E, generator=g)
            bias = torch.empty(E, dtype=torch.float64)
            bias[perm] = logp
            phase_bias.append(bias.tolist())
        u = torch.rand(sample_tokens, E, generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        logits = (bias - torch.log(-torch.log(u))).float()
        top2 = logits.topk(2, dim=1).indices.reshape(-1)
        counts[t] = torch.bincount(top2, minlength=E).double() * (tokens / sample_tokens)
        fast[t] = fast_signal(logits, 20)
    return (counts, fast, phase_bias) if biases else (counts, fast)


# -- simulation ---------------------------------------------------------------------------------


def rank_tokens(m: ExpertMap, load, speeds, proportional: bool) -> List[float]:
    out = [0.0] * m.world_size
    for e in range(m.num_experts):
        rs = m.ranks_of(e)
        tot = sum(speeds[r] for r in rs) if proportional else len(rs)
        for r in rs:
            out[r] += load[e] * ((speeds[r] / tot) if proportional else 1.0 / tot)
    return out


def simulate(policy: str, counts, fast, speeds: List[float], redundant: int, mfu: float, cooldown: int,
             record: Sequence[int] = ()):
    """Run one placement policy over the trace. ``record``: steps whose map in force (after that
    step's plan) is returned under ``"maps"`` as ``{step: [ranks of each expert]}``."""
    S, E = counts.shape
    W = len(speeds)
    sec_per_unit = FLOPS_PER_TOKEN / (1e12 * mfu)
    move_s = BYTES_PER_EXPERT / LINK_BPS
    static = ExpertMap.from_lists([[e * W // E] for e in range(E)], W)
    m = static
    bal = None
    if policy == "hetcomm":
        cfg = BalancerConfig(redundant=redundant, cooldown=cooldown, link_bytes_per_s=LINK_BPS,
                             seconds_per_unit=sec_per_unit)
        bal = ExpertBalancer(E, speeds, cfg, bytes_per_expert=BYTES_PER_EXPERT, initial=static,
                             slots=[2 * (E + redundant) // W] * W)
    step_times, compute_times, imbalances = [], [], []
    copies_moved = 0
    maps: Dict[int, List[List[int]]] = {}
    want = set(record)
    for t in range(S):
        load = counts[t].tolist()
        extra = 0.0
        if policy == "hetcomm":
            bal.observe(counts[t], fast=fast[t])
            plan = bal.maybe_rebalance()
            if plan is not None:
                n = sum(1 for mv in plan.moves if mv.dst is not None)
                copies_moved += n
                extra = n * move_s
                m = bal.map
        elif policy == "EPLB" and t >= 100 and t % 50 == 0:
            window = counts[t - 100 : t].mean(dim=0).tolist()
            new = eplb_rebalance(window, E + redundant, W)
            n = sum(1 for mv in diff_maps(m, new) if mv.dst is not None)
            copies_moved += n
            extra = n * move_s
            m = new
        if t in want:
            maps[t] = [list(rs) for rs in m.lists()]
        L = rank_tokens(m, load, speeds, proportional=False)
        tt = [L[r] / speeds[r] for r in range(W)]
        imbalances.append(max(tt) / (sum(tt) / W))
        step_times.append(max(tt) * sec_per_unit + extra)
        compute_times.append(max(tt) * sec_per_unit)
    out = {
        "policy": policy,
        "mean_max_over_mean": sum(imbalances) / S,
        "mean_step_ms": 1e3 * sum(step_times) / S,
        "tokens_per_s": counts.sum().item() / sum(step_times),
        "tokens_per_s_free_moves": counts.sum().item() / sum(compute_times),
        "copies_moved": copies_moved,
        "maps": maps,
    }
    if bal is not None:
        out["cooldown_violations"] = len(bal.cooldown_violations())
        out["plans_adopted"] = len({s for s, _ in bal.migrations})
        out["max_moves_per_expert"] = max([sum(1 for _, mv in bal.migrations if mv.expert == e) for e in range(E)])
        out["map_bytes"] = bal.map.nbytes()
    return out


def cluster_speeds(name: str) -> List[float]:
    """Rank speeds of ``mixed``, ``half``, ``equal`` (4 x 312) or a cluster YAML's path."""
    if name == "equal":
        return [312.0] * 4
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.topo.compute import rank_speeds

    path = {"mixed": "mixed-mini.yaml", "half": "mixed-mini-halfspeed.yaml"}.get(name)
    path = os.path.join(REPO, "configs", "clusters", path) if path else name
    return [float(s) for s in rank_speeds(load_cluster(path))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--phase", type=int, default=500, help="steps between hot-set changes")
    ap.add_argument("--tokens", type=int, default=65536, help="modelled tokens per step (all ranks)")
    ap.add_argument("--sample-tokens", type=int, default=2048, help="tokens drawn per step")
    ap.add_argument("--redundant", type=int, default=8, help="redundant expert copies (EPLB and hetcomm)")
    ap.add_argument("--cooldown", type=int, default=1000)
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--clusters", default="mixed,half,equal")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# bench_balancer: E={args.experts} W=4 steps={args.steps} hot set changes every {args.phase}; "
          f"{args.tokens} tokens/step top-2; redundant={args.redundant}; cooldown={args.cooldown}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {os.getloadavg()[0]:.2f}")
    results: Dict[str, Dict[str, List[dict]]] = {}
    seeds = [int(s) for s in args.seeds.split(",")]
    traces = {s: make_trace(args.experts, args.steps, args.sample_tokens, args.tokens, args.phase, s) for s in seeds}
    for cl in args.clusters.split(","):
        speeds = cluster_speeds(cl)
        for pol in ("static", "EPLB", "hetcomm"):
            for s in seeds:
                counts, fast = traces[s]
                results.setdefault(cl, {}).setdefault(pol, []).append(
                    simulate(pol, counts, fast, speeds, args.redundant, args.mfu, args.cooldown))
    print("| cluster (speeds) | placement | mean max/mean rank load | tokens/s vs static | vs EPLB | "
          "vs EPLB, moves free | expert copies moved | cooldown violations |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for cl, pols in results.items():
        speeds = cluster_speeds(cl)

        def mean(pol, key):
            return sum(r[key] for r in pols[pol]) / len(pols[pol])

        for pol in ("static", "EPLB", "hetcomm"):
            row = {
                "cluster": cl, "speeds": speeds, "placement": pol,
                "imbalance": mean(pol, "mean_max_over_mean"),
                "vs_static": mean(pol, "tokens_per_s") / mean("static", "tokens_per_s"),
                "vs_eplb": mean(pol, "tokens_per_s") / mean("EPLB", "tokens_per_s"),
                "vs_eplb_free": mean(pol, "tokens_per_s_free_moves") / mean("EPLB", "tokens_per_s_free_moves"),
                "copies_moved": mean(pol, "copies_moved"),
                "cooldown_violations": sum(r.get("cooldown_violations", 0) for r in pols[pol]),
            }
            rows.append(row)
            print(f"| {cl} ({'/'.join(f'{s:g}' for s in speeds)}) | {pol} | {row['imbalance']:.3f} | "
                  f"{row['vs_static']:.2f}x | {row['vs_eplb']:.2f}x | {row['vs_eplb_free']:.2f}x | {row['copies_moved']:.0f} | "
                  f"{row['cooldown_violations'] if pol == 'hetcomm' else '-'} |")
    het = results[next(iter(results))]["hetcomm"][0]
    print(f"# expert->rank map (CSR) of this run: {het['map_bytes']} bytes; 64 experts on 80 ranks with 16 replicas: "
          f"{4 * (3 + 64 + 80)} bytes")
    print(f"# means over seeds {seeds}; load average at end {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
