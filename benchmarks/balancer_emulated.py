"""Expert balancer vs static placement vs EPLB, MEASURED on the emulated cluster (issue 12).

``bench_balancer.py`` models every step of a 3,000-step Zipf(1.2) trace whose hot set changes
every 500 steps. This benchmark keeps its trace and its decisions and measures what they cost on
real ranks: ``hetcomm emulate up --compute`` (one cpu cgroup per rank, quota = the rank's relative
TFLOPS x ``cpu_per_rank``; links shaped at ``--scale``) for each cluster:

    mixed   configs/clusters/mixed-mini.yaml            A100, A100, H800, 910B (312/312/989.5/320)
    half    configs/clusters/mixed-mini-halfspeed.yaml  100/100/100/50: the 910B at half speed
    equal   configs/clusters/mixed-mini-equal.yaml      100/100/100/100

What is decided offline (in this process, before the ranks start), per cluster: the three
placements over the whole trace, with ``bench_balancer.simulate`` (the same code as the model):
``static`` (16 experts per rank, never moved), ``EPLB`` (DeepSeek's published algorithm,
github.com/deepseek-ai/EPLB ``eplb.py``: ``replicate_experts`` + ``balanced_packing``, global
policy, re-run every 50 steps on the last 100 steps, implemented in bench_balancer.py) and
``hetcomm`` (``hetcomm.moe.balancer.ExpertBalancer``, fed the cluster's declared speeds), both with
8 redundant copies. The map in force at a sample of steps is recorded: per phase of the hot set,
one step in the middle of each segment ``--segments`` (default 0-50 and 50-500 steps into the
phase: the transient after a hot-set change, and the settled part), weighted by the segment's
length.

What is measured, on the 4 emulated ranks: for each sampled step and each placement, one MoE
step (forward + backward) of ``hetcomm.Communicator.dispatch`` -> expert FFNs
(``Linear(D, F) + GELU + Linear(F, D)``, one module per physical copy) -> ``combine`` ->
``mean(out^2)``, backward through the same exchanges. The tokens (``--tokens`` per rank) are
routed like the trace's step: top-2 of that phase's gate bias + Gumbel noise (Zipf(1.2) first
choices). A replicated expert's tokens go to its copies in turn (token ``i`` to copy
``i mod n``: the even split both EPLB and hetcomm assume). Step time = barrier to end of
backward, slowest rank; placements alternate inside every round (rotating order), the median
over rounds is kept. Migration: every rank pair that crosses nodes times the transfer of one
expert's parameters and Adam state (3 x fp32 parameters) with ``send``/``recv`` on the emulated
links; the median is charged, in full, for every copy a placement moved over the trace
(asynchronous in hetcomm, so this is an upper bound for it; EPLB ignores the cost).

Throughput over the run = trace tokens / (sum over samples of weight x measured step + copies
moved x measured copy time). Not measured: replicas' gradient reduction (EPLB and hetcomm carry
the same 8 copies; static none), the gate.

    .venv/bin/python benchmarks/balancer_emulated.py            # as root: namespaces, cgroups

Device kinds are labels (CPU processes); links, transports and CPU quotas are real. Every
emulation is torn down on exit, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from emulated_runs import run_in_emulation  # noqa: E402
from placement_speed import machine_info  # noqa: E402

WORLD_SIZE = 4
POLICIES = ("static", "EPLB", "hetcomm")
CLUSTERS = {
    "mixed": "mixed-mini.yaml",
    "half": "mixed-mini-halfspeed.yaml",
    "equal": "mixed-mini-equal.yaml",
}


# -- one rank (inside the emulation) ----------------------------------------------------------


def _physical(ranks: List[List[int]]):
    """CSR of a map: (indptr [E+1], owner of each physical copy [nnz])."""
    indptr, owner = [0], []
    for rs in ranks:
        owner.extend(rs)
        indptr.append(len(owner))
    return indptr, owner


def _rank_main(args) -> int:
    import datetime as dt

    import torch
    import torch.distributed as dist

    import hetcomm

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("hetcomm", rank=rank, world_size=world, timeout=dt.timedelta(seconds=args.timeout))
    try:
        with open(args.plan) as f:
            plan = json.load(f)
        comm = hetcomm.communicator()
        E, D, F, T = plan["experts"], args.model_dim, args.hidden_dim, args.tokens
        samples = plan["samples"]
        # One module per physical copy this rank may hold (weights do not change the time).
        most = max(sum(1 for rs in s["maps"][p] for r in rs if r == rank) for s in samples for p in POLICIES)
        torch.manual_seed(7)
        pool = [torch.nn.Sequential(torch.nn.Linear(D, F), torch.nn.GELU(), torch.nn.Linear(F, D))
                for _ in range(most)]
        times: Dict[str, List[List[float]]] = {p: [] for p in POLICIES}
        rows: Dict[str, List[int]] = {p: [] for p in POLICIES}
        order = list(POLICIES)
        for i, s in enumerate(samples):
            g = torch.Generator().manual_seed(1000 * i + rank)
            bias = torch.tensor(s["bias"], dtype=torch.float32)
            u = torch.rand(T, E, generator=g).clamp(1e-9, 1 - 1e-9)
            logits = bias - torch.log(-torch.log(u))
            topw, topi = torch.softmax(logits, dim=1).topk(2, dim=1)
            topw = topw / topw.sum(dim=1, keepdim=True)
            x = torch.randn(T, D, generator=g)
            tok = torch.arange(T, dtype=torch.int64).unsqueeze(1) + rank * T  # global token id
            routes = {}
            for p in POLICIES:
                indptr, owner = _physical(s["maps"][p])
                ip = torch.tensor(indptr, dtype=torch.int64)
                n = ip[1:] - ip[:-1]
                # Copy (token + slot) mod n of the chosen expert: an even split over its copies.
                phys = ip[topi] + (tok + torch.arange(2).unsqueeze(0)) % n[topi]
                routes[p] = (phys, owner)
            for rnd in range((args.warmup if i == 0 else 0) + args.rounds):
                warm = args.warmup if i == 0 else 0
                for p in order:
                    phys, owner = routes[p]
                    for m in pool:
                        m.zero_grad(set_to_none=True)
                    xi = x.clone().requires_grad_(True)
                    dist.barrier()
                    t0 = time.perf_counter()
                    recv_x, counts, handle = comm.dispatch(xi, phys, topw, expert_to_rank=owner)
                    parts = recv_x.split(counts)
                    y = torch.cat([pool[j](part) for j, part in enumerate(parts)]) if parts else recv_x
                    out = comm.combine(y, handle)
                    out.square().mean().backward()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    if rnd >= warm:
                        if rnd == warm:
                            times[p].append([])
                            rows[p].append(int(sum(counts)))
                        times[p][-1].append(float(t))
                order = order[1:] + order[:1]  # rotate: no placement always goes first
        # One expert's migration payload (parameters + Adam's two moments, fp32) per node pair.
        nparam = sum(q.numel() for q in pool[0].parameters()) if pool else 2 * D * F + D + F
        buf = torch.zeros(3 * nparam, dtype=torch.float32)
        copy_s: Dict[str, List[float]] = {}
        for src, dst in plan["pairs"]:
            key = f"{src}->{dst}"
            for _ in range(args.copy_repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == src:
                    dist.send(buf, dst)
                elif rank == dst:
                    dist.recv(buf, src)
                t = torch.tensor([time.perf_counter() - t0 if rank == dst else 0.0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                copy_s.setdefault(key, []).append(float(t))
        with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "times": times, "rows": rows, "copy_s": copy_s,
                       "copy_bytes": buf.numel() * 4}, f)
        return 0
    finally:
        dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------


def cross_node_pairs(cluster) -> List[List[int]]:
    """One (src, dst) per pair of nodes, lowest ranks: where a migration crosses a link."""
    first: Dict[str, int] = {}
    for r in range(cluster.num_ranks):
        first.setdefault(cluster.node_of(r).name, r)
    ranks = sorted(first.values())
    return [[a, b] for i, a in enumerate(ranks) for b in ranks[i + 1:]]


def offline(cluster_path: str, trace, args) -> Dict[str, Any]:
    """The three placements over the whole trace (modelled figures + maps at the samples)."""
    import bench_balancer as bb

    counts, fast, biases = trace
    speeds = bb.cluster_speeds(cluster_path)
    bounds = [int(b) for b in args.segments.split(",")]
    samples = []
    for ph in range(args.steps // args.phase):
        for lo, hi in zip(bounds, bounds[1:]):
            samples.append({"step": ph * args.phase + (lo + hi) // 2, "weight": hi - lo, "phase": ph})
    sims = {p: bb.simulate(p, counts, fast, speeds, args.redundant, args.mfu, args.cooldown,
                           record=[s["step"] for s in samples]) for p in POLICIES}
    for s in samples:
        s["bias"] = biases[s["phase"]]
        s["maps"] = {p: sims[p]["maps"][s["step"]] for p in POLICIES}
    model = {p: {k: v for k, v in sims[p].items() if k != "maps"} for p in POLICIES}
    return {"speeds": speeds, "samples": samples, "model": model, "experts": args.experts}


def summarize(plan: Dict[str, Any], run: Dict[int, Any], args) -> Dict[str, Any]:
    r0 = run[0]
    samples = plan["samples"]
    copy_s = statistics.median(v for vals in r0["copy_s"].values() for v in vals)
    tokens = args.steps * args.tokens * WORLD_SIZE
    out: Dict[str, Any] = {"copy_s": copy_s, "copy_bytes": r0["copy_bytes"],
                           "copy_s_pairs": {k: statistics.median(v) for k, v in r0["copy_s"].items()},
                           "policies": {}}
    for p in POLICIES:
        med = [statistics.median(ts) for ts in r0["times"][p]]
        compute = sum(s["weight"] * m for s, m in zip(samples, med))
        moved = plan["model"][p]["copies_moved"]
        # Per sample: rows (token copies) each rank computed, over its speed: the measured routing's balance.
        imb = []
        for i in range(len(samples)):
            t = [run[r]["rows"][p][i] / plan["speeds"][r] for r in range(WORLD_SIZE)]
            imb.append(max(t) / (sum(t) / len(t)))
        out["policies"][p] = {
            "step_ms_median": 1e3 * statistics.median(med),
            "run_s": compute + moved * copy_s,
            "run_s_free": compute,
            "tokens_per_s": tokens / (compute + moved * copy_s),
            "copies_moved": moved,
            "sample_imbalance": sum(s["weight"] * x for s, x in zip(samples, imb)) / sum(s["weight"] for s in samples),
            "model_imbalance": plan["model"][p]["mean_max_over_mean"],
            "model_tokens_per_s": plan["model"][p]["tokens_per_s"],
            "model_tokens_per_s_free": plan["model"][p]["tokens_per_s_free_moves"],
        }
        if p == "hetcomm":
            out["policies"][p]["cooldown_violations"] = plan["model"][p]["cooldown_violations"]
    P = out["policies"]
    for p in POLICIES:
        P[p]["vs_static"] = P["static"]["run_s"] / P[p]["run_s"]
        P[p]["vs_eplb"] = P["EPLB"]["run_s"] / P[p]["run_s"]
        P[p]["vs_eplb_free"] = P["EPLB"]["run_s_free"] / P[p]["run_s_free"]
        P[p]["model_vs_static"] = P[p]["model_tokens_per_s"] / P["static"]["model_tokens_per_s"]
        P[p]["model_vs_eplb"] = P[p]["model_tokens_per_s"] / P["EPLB"]["model_tokens_per_s"]
    return out


def targets(results: Dict[str, Dict[str, Any]]) -> List[str]:
    """Issue 12's balancer targets, on the measured ratios, for the clusters that ran."""
    out = []

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    for cl, res in results.items():
        v = res["summary"]["policies"]
        out.append(f"# target {cl}: hetcomm max/mean {v['hetcomm']['model_imbalance']:.3f} (static "
                   f"{v['static']['model_imbalance']:.3f}) <= 1.15: {met(v['hetcomm']['model_imbalance'] <= 1.15)}; "
                   f"cooldown violations {v['hetcomm']['cooldown_violations']}")
    if "mixed" in results:
        r = results["mixed"]["summary"]["policies"]["hetcomm"]["vs_static"]
        out.append(f"# target mixed: hetcomm / static {r:.2f}x >= 1.2x: {met(r >= 1.2)}")
    if "half" in results:
        r = results["half"]["summary"]["policies"]["hetcomm"]["vs_eplb"]
        out.append(f"# target half: hetcomm / EPLB {r:.2f}x >= 1.15x: {met(r >= 1.15)}")
    if "equal" in results:
        r = results["equal"]["summary"]["policies"]["hetcomm"]["vs_eplb"]
        out.append(f"# target equal: hetcomm / EPLB {r:.2f}x within 5% (>= 0.95x): {met(r >= 0.95)}")
    return out


def render(results: Dict[str, Dict[str, Any]], args, before, after, elapsed: float) -> str:
    lines = [
        f"# balancer_emulated: E={args.experts} W=4 k=2, trace {args.steps} steps (hot set every {args.phase}, seed "
        f"{args.seed}), redundant {args.redundant}, cooldown {args.cooldown}; measured step: D={args.model_dim} "
        f"F={args.hidden_dim} T={args.tokens}/rank, {args.rounds} rounds per sample (+{args.warmup} warm-up), "
        f"segments {args.segments}; --scale {args.scale:g}",
        f"# machine {before['host']}, {before['nproc']} CPUs, {before['cpu']}; {before['date']} UTC; "
        f"load {before['loadavg']} before, {after['loadavg']} after; {elapsed:.0f} s",
        "",
        "| cluster | placement | max/mean load, model (run) | max/mean, measured routing (samples) | median step | "
        "copies moved | tokens/s vs static: measured (model) | vs EPLB: measured (model) | vs EPLB, moves free | "
        "cooldown violations |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cl, res in results.items():
        s = res["summary"]
        for p in POLICIES:
            v = s["policies"][p]
            lines.append(
                f"| {cl} ({'/'.join(f'{x:g}' for x in res['speeds'])}) | {p} | {v['model_imbalance']:.3f} | "
                f"{v['sample_imbalance']:.3f} | {v['step_ms_median']:.0f} ms | {v['copies_moved']} | "
                f"{v['vs_static']:.2f}x ({v['model_vs_static']:.2f}x) | {v['vs_eplb']:.2f}x ({v['model_vs_eplb']:.2f}x) | "
                f"{v['vs_eplb_free']:.2f}x | {v.get('cooldown_violations', '-')} |")
    lines.append("")
    lines += targets(results)
    for cl, res in results.items():
        s = res["summary"]
        lines.append(f"# {cl}: one expert copy ({s['copy_bytes'] / 1e6:.1f} MB) moves in {s['copy_s'] * 1e3:.1f} ms "
                     f"(median; per pair " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s["copy_s_pairs"].items()) + ")")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="mixed,half,equal", help="names (mixed, half, equal) or YAML paths")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--phase", type=int, default=500, help="steps between hot-set changes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-tokens", type=int, default=65536, help="modelled tokens per step (the decisions)")
    ap.add_argument("--sample-tokens", type=int, default=2048, help="tokens drawn per trace step")
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--cooldown", type=int, default=1000)
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--segments", default="0,50,500", help="sample one step in the middle of each segment of a phase")
    ap.add_argument("--scale", type=float, default=1e-2, help="emulated link rate factor")
    ap.add_argument("--tokens", type=int, default=1024, help="measured tokens per rank")
    ap.add_argument("--model-dim", type=int, default=256)
    ap.add_argument("--hidden-dim", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per sample (every placement once each)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the first sample")
    ap.add_argument("--copy-repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one emulated run may take")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        return _rank_main(args)

    import torch

    import bench_balancer as bb
    from hetcomm.topo.cluster import load_cluster

    torch.set_num_threads(1)
    before = machine_info()
    t_start = time.monotonic()
    print(f"balancer_emulated: trace of {args.steps} steps ...", file=sys.stderr, flush=True)
    trace = bb.make_trace(args.experts, args.steps, args.sample_tokens, args.model_tokens, args.phase, args.seed,
                          biases=True)
    results: Dict[str, Dict[str, Any]] = {}
    tmp = tempfile.mkdtemp(prefix="balancer_emulated.")
    try:
        for name in args.clusters.split(","):
            path = os.path.join(REPO, "configs", "clusters", CLUSTERS[name]) if name in CLUSTERS else name
            cluster = load_cluster(path)
            if cluster.num_ranks != WORLD_SIZE:
                print(f"balancer_emulated: {path} must have {WORLD_SIZE} ranks", file=sys.stderr)
                return 2
            print(f"balancer_emulated: {name}: placements over the trace ...", file=sys.stderr, flush=True)
            plan = offline(path, trace, args)
            plan["pairs"] = cross_node_pairs(cluster)
            args.plan = os.path.join(tmp, f"plan-{len(results)}.json")
            with open(args.plan, "w") as f:
                json.dump(plan, f)
            args.cluster, args.runs = path, 1
            rc, runs = run_in_emulation(
                "balancer_emulated", __file__, args,
                ("model_dim", "hidden_dim", "tokens", "rounds", "warmup", "copy_repeats", "timeout", "plan"),
                WORLD_SIZE, up_options=("--compute",), up_timeout=180,
            )
            if rc != 0:
                return rc
            results[name] = {"speeds": plan["speeds"], "summary": summarize(plan, runs[0], args),
                             "samples": [{k: s[k] for k in ("step", "weight")} for s in plan["samples"]],
                             "times": {p: runs[0][0]["times"][p] for p in POLICIES}}
    finally:
        for fn in os.listdir(tmp):
            os.unlink(os.path.join(tmp, fn))
        os.rmdir(tmp)
    after = machine_info()
    print(render(results, args, before, after, time.monotonic() - t_start))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_before": before, "machine_after": after, "args": vars(args), "results": results},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
