"""The eight skew workloads W0-W7 (``hetcomm.moe.workloads``) on the real ``MoELayer``, four
ranks of the heterogeneity testbed, four policies side by side: target T3.

Brings up ``hetcomm emulate up --compute`` of ``--cluster`` (default
``configs/clusters/mislabelled-halfspeed.yaml``: every device labelled alike, rank 3 at half the
CPU quota) and runs, on its 4 ranks over the hetcomm backend (``init_process_group("hetcomm")``
with the cluster as its option, as ``hetcomm train`` does), for each workload and each pair, four
fresh layers, one per policy, trained step by step in an order that rotates every step:

- ``token-equal`` (speed-blind exact token balancing, MoonEP-style): equal contiguous placement,
  the hot experts copied on every rank, and the layer's per-step split (``token_split``) run with
  equal given speeds, so each rank computes as nearly ``total / W`` rows as the copies allow;
  nothing reads a speed.
- ``EPLB`` (DeepSeek's balanced packing, ``bench_balancer.eplb_balanced_packing``, speed-blind):
  the same hot-expert copies (each rank computes its own tokens' rows of them: rows spread
  evenly over the copies), and every ``--eplb-every`` steps the owners re-packed, equal experts
  per rank, by the last ``2 x`` that many steps' global loads (a hot expert weighs ``load / W``:
  its copies take the rest), moved with ``migration.migrate_now`` inside the step that plans it.
- ``default``: ``MoELayer(..., cluster=, replicate=True)`` with the layer's defaults and
  ``MeasuredLoop(layer, opt).after_step(step)`` after every optimizer step: what a user of the
  layer gets (measured speeds, the policy's verdict, the one placement by speed).
- ``oracle``: the known quotas (``hetcomm.train.speed_modes``: placement weights, replica holders
  and given speeds, ``token_split`` on, the policy with ``speed="oracle"``): what
  ``hetcomm train --speed oracle --token-split on`` sets.
- ``default-copies``, with ``--compare-copies EVERY,ALPHA`` only: the default with its hot set
  re-chosen every ``EVERY`` steps from an EMA of decay ``ALPHA`` (``replicate_every``,
  ``replicate_alpha``), timed beside the rest: how the copies' cadence decides a step.

Every policy copies the hot experts with the layer's cadence (``MoEConfig.replicate_every`` and
``replicate_alpha``), so the comparisons isolate what each does with the copies and the speeds.

Links: ``--scale`` (default 1e-2, the testbed cluster file's own rate). Replication is on for
every policy, and each hot expert's weight refresh and gradient sum cross the emulated links
every step: at 1e-3 (the emulation's default, ``--scale 1e-3``) they alone outweigh the expert
work of a few thousand rows per rank, and no policy could show a difference.

Routing: the workload's, exactly. ``MoELayer`` has no fixed-routing input, so the gate is made to
pick it: its weight is frozen to the identity on the first ``E`` input dimensions, where each
token carries ``8`` at its first expert, ``7`` at its second and ``0`` elsewhere (dropless, no
calibration): its top-k is ``workload_routing(w, spec, seed, step, rank)``.

The slow rank's expert share: its forward expert seconds times 3 (forward and backward) over
the step time, median over steps: how much of a step any balancing can act on.

One step, timed on every rank from a barrier, reported as the slowest rank's: forward, backward
(the replica-gradient all-reduce runs at its end), ``AdamW.step()``, then the policy's after-step
work (the replica weight refresh, ``sync_replicas(force=True)``, for all four; the measured loop's
verdict and placement for ``default`` and ``oracle``; EPLB's re-pack when due). The first
``--warmup`` steps are not timed (the default's placement by speed needs a few agreements).

The model's prediction: a step takes ``o + c * M``, with ``M`` the step's makespan in rows, the
slowest rank's ``rows_r / q_r`` (rows the rank's experts and replicas computed, forward; ``q``
the emulation's quotas). ``c`` (seconds of one row at full speed, forward and backward) and
``o`` (the rest of a step: gate, exchanges, optimizer, refresh) are measured on token-equal in
the same pair: ``c`` its slowest rank's expert seconds x ``FORWARD_AND_BACKWARD`` over ``M``,
``o`` its step time less ``c * M`` (medians over the timed steps). Each policy's predicted time
is ``o + c *`` its own median ``M``: whether the rows a policy gives each rank explain its time.
The predicted ratio of two policies (median over pairs) stands beside the measured one.

    sudo PYTHONPATH=. .venv/bin/python benchmarks/moe_workloads_layer.py --pairs 5
    sudo PYTHONPATH=. .venv/bin/python benchmarks/moe_workloads_layer.py --pairs 1 --steps 3 \\
        --warmup 12 --workloads W0,W1 --max-load 100                                    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

WORLD_SIZE = 4
POLICIES = ("token-equal", "EPLB", "default", "oracle")
#: With ``--compare-copies EVERY,ALPHA``: the default layer whose hot set is re-chosen every
#: ``EVERY`` steps from an EMA of decay ``ALPHA`` (``replicate_every``, ``replicate_alpha``), timed
#: beside the others: a decision on the layer's defaults for the copies' cadence.
COPIES = "default-copies"
HOT = ("W1_hot_set", "W2_hot_rank", "W3_spread", "W6_rotating_hotspot", "W7_burst")  # T3's workloads with a hot set


def policies_of(compare_copies: Optional[str]) -> tuple:
    """The policies of a run: :data:`POLICIES`, and :data:`COPIES` when it compared copies."""
    return POLICIES + ((COPIES,) if compare_copies else ())


def parse_workloads(text: str) -> List[str]:
    """``"W0,w3,burst"`` or ``"all"`` -> full workload names, in the order given."""
    from hetcomm.moe.workloads import WORKLOADS, resolve_workload

    if text.strip().lower() == "all":
        return list(WORKLOADS)
    names = [resolve_workload(t) for t in text.split(",") if t.strip()]
    if not names:
        raise SystemExit("moe_workloads_layer: --workloads names no workload (e.g. W1,W3 or all)")
    return names


def eplb_owners(load: Sequence[float], hot: Sequence[int], world_size: int) -> List[int]:
    """``[E]`` owners by EPLB's balanced packing (equal experts per rank, heaviest first to the
    lightest rank with room) of ``load``, a hot expert (copied on every rank) weighing
    ``load / world_size``: its copies compute the rest."""
    import bench_balancer as bb

    w = [float(x) / world_size if e in set(hot) else float(x) for e, x in enumerate(load)]
    return bb.eplb_balanced_packing(w, world_size)


def model_makespan(rows: Sequence[float], quotas: Sequence[float]) -> float:
    """The rows/speed model of one step: the slowest rank's ``rows_r / q_r``."""
    return max(r / q for r, q in zip(rows, quotas))


def model_step_s(pair: Dict[str, Any], quotas: Sequence[float]) -> Dict[str, float]:
    """Each policy's predicted step time in one pair, ``o + c * median M`` (module docstring),
    with ``c`` and ``o`` measured on the pair's token-equal steps."""
    from hetcomm.moe.placement.migration import FORWARD_AND_BACKWARD

    ref = pair["token-equal"]
    spans = [model_makespan(rows, quotas) for rows in ref["rows"]]
    per_row = [FORWARD_AND_BACKWARD * es[max(range(len(rows)), key=lambda r: rows[r] / quotas[r])] / m
               for rows, es, m in zip(ref["rows"], ref["expert_s"], spans) if m > 0]  # the slowest rank's
    c = statistics.median(per_row) if per_row else 0.0
    o = statistics.median(t - c * m for t, m in zip(ref["step_s"], spans))
    return {p: o + c * statistics.median(model_makespan(rows, quotas) for rows in pair[p]["rows"]) for p in pair}


# -- one rank (inside the emulation) -----------------------------------------------------------


def _rank_main(args) -> int:
    import datetime as dt

    import torch
    import torch.distributed as dist

    from hetcomm.backends.options import HetcommOptions
    from hetcomm.moe import MeasuredLoop, MoELayer
    from hetcomm.moe.placement import migration, place_experts
    from hetcomm.moe.policy import policy_of_layers
    from hetcomm.moe.workloads import WorkloadSpec, workload_routing
    from moe_workloads import freeze_gate_to_routing, routed_input  # benchmarks/: on sys.path above
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.train import speed_modes

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cluster = load_cluster(args.cluster)
    dist.init_process_group("hetcomm", rank=rank, world_size=world, timeout=dt.timedelta(seconds=args.timeout),
                            pg_options=HetcommOptions(cluster=cluster))
    try:
        E, D, F, T, N = args.experts, args.model_dim, args.hidden_dim, args.tokens, args.replicate_top
        spec = WorkloadSpec(E, world, T, 2)
        quotas = speed_modes.oracle_speeds(cluster, world)

        def expert(d: int) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(d, F), torch.nn.GELU(), torch.nn.Linear(F, d))

        def make(policy: str, seed: int) -> Dict[str, Any]:
            common = dict(dropless=True, calibrate=False, cluster=cluster, replicate=True, replicate_top=N,
                          expert=expert, seed=seed)
            if policy == "default":
                layer = MoELayer(D, E, k=2, **common)
            elif policy == COPIES:
                every, alpha = parse_copies(args.compare_copies)
                layer = MoELayer(D, E, k=2, replicate_every=every, replicate_alpha=alpha, **common)
            elif policy == "oracle":
                layer = MoELayer(D, E, k=2, token_split=True, placement=place_experts(E, world, rank_weights=quotas),
                                 **common)
                speed_modes.apply_oracle([layer], quotas)
            else:  # speed-blind: equal contiguous owners, nothing measured
                layer = MoELayer(D, E, k=2, token_split=policy == "token-equal", speed_every=0,
                                 placement=place_experts(E, world), **common)
                layer.speed.set_prior([1.0] * world, given=True)
            freeze_gate_to_routing(layer, E, D)  # the gate picks the workload's experts (the module docstring)
            opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
            loop = None
            if policy in ("default", "oracle", COPIES):
                loop = MeasuredLoop(layer, opt, policy=policy_of_layers([layer], speed="oracle") if policy == "oracle" else None)
            loads: List[List[float]] = []
            if policy == "EPLB":
                layer.add_load_observer(lambda picks, probs, n, fast: loads.append(picks.double().tolist()))
            return {"layer": layer, "opt": opt, "loop": loop, "loads": loads, "events": []}

        def after(policy: str, st: Dict[str, Any], step: int) -> None:
            layer = st["layer"]
            if st["loop"] is not None:
                st["events"] += [f"step {step}: {e}" for e in st["loop"].after_step(step)]
                return
            layer.sync_replicas(force=True)
            if policy == "EPLB" and step % args.eplb_every == 0 and st["loads"]:
                window = st["loads"][-2 * args.eplb_every:]
                load = [sum(h[e] for h in window) / len(window) for e in range(E)]
                owners = eplb_owners(load, layer.replicator.hot if layer.replicator else (), world)
                moved = migration.migrate_now(layer, owners, st["opt"], timeout_s=args.timeout)
                if moved:
                    st["events"].append(f"step {step}: EPLB moved {len(moved)} experts")

        res: Dict[str, Any] = {}
        policies = policies_of(args.compare_copies)
        for pair in range(args.pairs):
            for w in args.workload_list:
                states = {p: make(p, seed=1000 * pair + 7) for p in policies}
                rec = {p: {"step_s": [], "rows": [], "expert_s": []} for p in policies}
                for step in range(1, args.warmup + args.steps + 1):
                    idx = workload_routing(w, spec, args.seed, step, rank)
                    # As a layer's input in a model, x is in the graph: its gradient flows on to
                    # the layers below, so the backward's exchanges are a model's.
                    x = routed_input(idx, E, D, step, rank).requires_grad_(True)
                    k0 = step % len(policies)
                    for p in policies[k0:] + policies[:k0]:  # rotate who goes first
                        st = states[p]
                        layer, opt = st["layer"], st["opt"]
                        opt.zero_grad(set_to_none=True)
                        dist.barrier()
                        t0 = time.perf_counter()
                        layer(x).square().mean().backward()
                        opt.step()
                        after(p, st, step)
                        t = torch.tensor([time.perf_counter() - t0])
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)
                        rows = torch.zeros(2, world)  # [rows computed, forward expert seconds] per rank
                        rows[0, rank] = float(layer.speed.last_step[0])
                        rows[1, rank] = float(layer.step_stats().expert_s)
                        dist.all_reduce(rows)
                        if step > args.warmup:
                            rec[p]["step_s"].append(float(t))
                            rec[p]["rows"].append(rows[0].tolist())
                            rec[p]["expert_s"].append(rows[1].tolist())
                for p in policies:
                    layer = states[p]["layer"]
                    rec[p]["owners_per_rank"] = list(layer.placement.num_local_experts_per_rank)
                    rec[p]["events"] = states[p]["events"]
                    rec[p]["speeds"] = list(layer.speed.speeds)
                    loop = states[p]["loop"]
                    rec[p]["cold"] = loop.cold.summary() if loop is not None else "off"
                res.setdefault(w, []).append(rec)
                if rank == 0:  # progress: a full run takes tens of minutes
                    ms = {p: 1e3 * statistics.median(rec[p]["step_s"]) for p in policies if rec[p]["step_s"]}
                    print(f"  pair {pair + 1}/{args.pairs} {w}: median step " +
                          ", ".join(f"{p} {v:.0f} ms" for p, v in ms.items()), flush=True)
            # Written after every pair: a run stopped at its timeout keeps the pairs it finished.
            with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as f:
                json.dump({"quotas": quotas, "copies": args.compare_copies, "runs": res}, f)
        return 0
    finally:
        dist.destroy_process_group()


# -- the table ---------------------------------------------------------------------------------


def summarize(result: Dict[str, Any]) -> Dict[str, Any]:
    """Per workload: each policy's median step time per pair, the median over pairs and the
    spread, the ratios of default to the others (ratio of medians, and per pair min-max), and
    the model's predicted ratio beside each."""
    from hetcomm.moe.placement.migration import FORWARD_AND_BACKWARD

    quotas = result["quotas"]
    policies = policies_of(result.get("copies"))
    slow = [r for r, q in enumerate(quotas) if q < max(quotas)]
    out: Dict[str, Any] = {}
    for w, pairs in result["runs"].items():
        med = {p: [statistics.median(r[p]["step_s"]) for r in pairs] for p in policies}
        model = [model_step_s(r, quotas) for r in pairs]
        row: Dict[str, Any] = {"median_s": {p: statistics.median(v) for p, v in med.items()},
                               "spread_s": {p: (min(v), max(v)) for p, v in med.items()}, "ratios": {},
                               "last": {p: {k: pairs[-1][p][k] for k in ("owners_per_rank", "events", "speeds", "cold")}
                                        for p in policies},
                               # The slow ranks' expert work (forward x FORWARD_AND_BACKWARD) over the
                               # step, per policy: how much of a step any balancing can act on.
                               "slow_expert_share": {p: statistics.median(
                                   FORWARD_AND_BACKWARD * max(es[s] for s in slow) / t
                                   for r in pairs for es, t in zip(r[p]["expert_s"], r[p]["step_s"])) if slow else None
                                   for p in policies}}
        for other in [p for p in policies if p != "default"]:
            per_pair = [o / d for o, d in zip(med[other], med["default"])]
            measured = statistics.median(med[other]) / statistics.median(med["default"])
            predicted = statistics.median(m[other] / m["default"] for m in model)
            # default's speedup over `other` (>1: default faster), for oracle default/oracle time.
            row["ratios"][other] = {"measured": measured, "pairs": (min(per_pair), max(per_pair)),
                                    "model": predicted, "model_error": predicted / measured - 1}
        out[w] = row
    return out


def render(summary: Dict[str, Any], args, header: str) -> str:
    copies = any(COPIES in r["median_s"] for r in summary.values())
    policies = policies_of(args.compare_copies if copies else None)
    extra = (f" {COPIES} ({args.compare_copies}) |", f" x {COPIES} |", "---|---|") if copies else ("", "", "")
    lines = [header, "",
             "median step s (slowest rank; min-max over pairs) per policy; x = the default's speedup over it "
             "(its median step time / the default's), measured (per-pair min-max) and by the model o + c x makespan",
             "| workload | token-equal | EPLB | default | oracle |" + extra[0] + " x token-equal (model) | x EPLB (model) | "
             "default/oracle time (model) | slow rank expert share, default / token-equal |" + extra[1],
             "|---|---|---|---|---|---|---|---|---|" + extra[2]]
    for w, r in summary.items():
        cells = [f"{r['median_s'][p]:.3f} ({r['spread_s'][p][0]:.3f}-{r['spread_s'][p][1]:.3f})" for p in policies]
        x = []
        for other in ("token-equal", "EPLB", "oracle"):
            q = r["ratios"][other]
            m, lo, hi, mo = q["measured"], *q["pairs"], q["model"]
            if other == "oracle":  # time ratio default / oracle
                m, lo, hi, mo = 1 / m, 1 / hi, 1 / lo, 1 / mo
            x.append(f"{m:.2f} ({lo:.2f}-{hi:.2f}) ({mo:.2f})")
        sh = r["slow_expert_share"]
        x.append(" / ".join("-" if sh[p] is None else f"{100 * sh[p]:.0f} %" for p in ("default", "token-equal")))
        if copies:
            q = r["ratios"][COPIES]
            x.append(f"{q['measured']:.2f} ({q['pairs'][0]:.2f}-{q['pairs'][1]:.2f})")
        lines.append(f"| {w}{' *' if w in HOT else ''} | " + " | ".join(cells + x) + " |")
    lines += ["", "* a workload with a hot set (T3: x token-equal >= 1.15, x EPLB >= 1.15, default/oracle <= 1.20, "
              "model within 15 %)"]
    last = list(summary)[-1]
    for p in policies:
        info = summary[last]["last"][p]
        ev = "; ".join(info["events"][-3:]) or "none"
        lines.append(f"{p} (last run of {last}): experts per rank {info['owners_per_rank']}, speeds "
                     f"{[round(s, 2) for s in info['speeds']]}, placement by speed: {info['cold']}, events: {ev}")
    return "\n".join(lines)


def parse_copies(text: str) -> tuple:
    """``"10,0.99"`` -> ``(10, 0.99)``: ``--compare-copies``."""
    every, _, alpha = text.partition(",")
    try:
        return int(every), float(alpha)
    except ValueError:
        raise SystemExit(f"moe_workloads_layer: --compare-copies expects EVERY,ALPHA (e.g. 10,0.99), got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="configs/clusters/mislabelled-halfspeed.yaml")
    ap.add_argument("--workloads", default="all", help="comma-separated (W1,W3 or hot_set,...) or 'all'")
    ap.add_argument("--pairs", type=int, default=5, help="fresh layers per workload, every policy each step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per workload and pair")
    ap.add_argument("--warmup", type=int, default=12, help="untimed steps first (the default measures and places)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    ap.add_argument("--replicate-top", type=int, default=4, help="hot experts copied (every policy)")
    ap.add_argument("--eplb-every", type=int, default=8, help="steps between EPLB's re-packs")
    ap.add_argument("--compare-copies", default=None, metavar="EVERY,ALPHA",
                    help="also time the default layer with replicate_every=EVERY, replicate_alpha=ALPHA")
    ap.add_argument("--model-dim", type=int, default=256)
    ap.add_argument("--hidden-dim", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1e-2, help="emulated link rate factor (default 1e-2, as the testbed cluster file: see the module)")
    ap.add_argument("--subnet", default="10.223.0.0/16")
    ap.add_argument("--max-load", type=float, default=2.0, help="start only below this 1-minute load")
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--workload-list", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        args.workload_list = args.workload_list.split(",")
        return _rank_main(args)
    args.workload_list = ",".join(parse_workloads(args.workloads))
    if args.compare_copies:
        parse_copies(args.compare_copies)  # a bad value stops here, before the emulation starts
    args.cluster = os.path.join(REPO, args.cluster) if not os.path.isabs(args.cluster) else args.cluster

    from emulated_runs import run_in_emulation
    from het_testbed import _load, _wait_for_quiet

    cmd = " ".join(["benchmarks/moe_workloads_layer.py", *(argv if argv is not None else sys.argv[1:])])
    if not _wait_for_quiet(args.max_load, 1800.0):
        print(f"moe_workloads_layer: the load stayed >= {args.max_load:g}; not started", file=sys.stderr)
        return 3
    rev = os.popen(f"git -C {REPO} rev-parse --short HEAD").read().strip()
    load0, t0 = _load(), time.monotonic()
    args.runs = 1
    rc, runs = run_in_emulation(
        "moe_workloads_layer", __file__, args,
        ("cluster", "workload_list", "pairs", "steps", "warmup", "experts", "tokens", "replicate_top", "eplb_every",
         *(("compare_copies",) if args.compare_copies else ()),
         "model_dim", "hidden_dim", "seed", "timeout"),
        WORLD_SIZE, up_options=("--compute", "--subnet", args.subnet), up_timeout=180,
    )
    if rc != 0:
        return rc
    summary = summarize(runs[0][0])
    header = (f"$ {cmd}\n{os.path.relpath(args.cluster, REPO)} under emulate --compute (quotas "
              f"{runs[0][0]['quotas']}), hetcomm backend, {args.experts} experts, top-2, {args.tokens} tokens/rank, "
              f"D={args.model_dim}, F={args.hidden_dim}, {args.replicate_top} hot experts copied, {args.pairs} pair(s) x "
              f"{args.steps} timed steps after {args.warmup}; commit {rev}, start load {load0:.2f}, end load "
              f"{_load():.2f}, {time.monotonic() - t0:.0f} s")
    print(render(summary, args, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "raw": runs[0][0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
