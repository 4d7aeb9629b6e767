"""Communication-bound MoE step on the emulated mixed cluster: hetcomm's MoELayer vs DeepSpeed-MoE.

Issue 6, item 4. ``hetcomm emulate`` builds ``configs/clusters/mixed-mini.yaml`` from network
namespaces and tc-shaped veths (2 A100 ranks on node a100-0, 1 H800 rank, 1 910B rank; with
``--scale 1e-3`` a 200 Gb/s port is 200 Mbit/s and the cross-vendor bridge 100 Mbit/s). One
process per rank runs, in turns inside every round (so machine noise hits every variant alike),
one MoE layer step (forward + backward of ``mean(y^2) + 0.01 * l_aux``) of:

    deepspeed        deepspeed.moe.layer.MoE(hidden_size=D, expert=Linear(D,F)+GELU+Linear(F,D),
                     num_experts=E, ep_size=4, k=2, capacity_factor=1.25) over gloo (default
                     group, TCP across the shaped links)
    hetcomm          MoELayer, same E/k/capacity/expert, hetcomm backend, direct (flat) exchange,
                     wire dtype from the cluster YAML (FP16 on pairs with the 910B), hot-expert
                     replication (top 3, hot set re-chosen every step) with
                     replicate_policy="profitable": an expert is replicated only if the
                     all-to-all bytes it saves exceed its weight + gradient sync bytes
    hetcomm -fp16    the same with wire_dtype="fp32"                  (gain: the wire dtype)
    hetcomm -rep     the same with replicate=False                    (gain: replication)
    hetcomm plan=hier, hetcomm plan=auto
                     the same with HetcommOptions(plan="hier") (a node's traffic through its
                     leader) or plan="auto" (the planner simulates flat, hier and multirail for
                     each exchange and runs the fastest)                (gain: the plan)
    hetcomm rep=always
                     the same, replicating the top 3 whatever they cost
    hetcomm bare     FP32 wire, no replication: what is left is the layer itself (uneven,
                     unpadded all-to-all of the kept copies only)

Routing: both gates get the same ``[E, D]`` weight and every rank the same kind of input (see
:func:`zipf_gate_weight`): feature 0 is the constant 1, features ``1..E`` are i.i.d. Gumbel(0, 1),
and the gate weight is ``log p_e`` in column 0 plus the identity on columns ``1..E``. The logits are
then ``log p_e + g_e``, so by the Gumbel-max trick the first choice is exactly Zipf(1.2). Both
libraries' calibration/noise extras are as shipped except hetcomm's load calibration, which is off
(it would flatten the skew we want to measure; DeepSpeed has none). DeepSpeed's top-2 gate adds
its own Gumbel noise to the logits for the second choice; hetcomm takes the plain second-largest.

All-to-all bytes per link class: every ``torch.distributed.all_to_all_single`` call in a rank
process (both libraries go through it) is wrapped to add ``input_split_sizes[p] * row_bytes`` to
the link class of (this rank, p) (``Cluster.link_class``): the logical bytes each pair exchanges,
wire dtype applied, forward and backward, the small count exchanges included. A plan may relay
them (the hier plan moves a node's bytes through its leader), so the rail counters of
``hetcomm.stats()`` (bytes actually sent per rail, split checks and replica syncs included) are
reported too.

Timing: each step from a barrier to the end of backward on every rank; the step time is the
slowest rank's. After every step (untimed) an SGD step with lr=0 bumps weight versions, so
replication pays its per-step replica refresh as in training while routing stays stationary.
Per run: median of the timed steps; the table gives the median over runs and the range.

    .venv-bench/bin/python benchmarks/moe_emulated.py --runs 3      # root; 4 min at load 2-9, 8 at load 20

Device kinds are labels (all ranks are CPU processes); the links (shaped veths, TCP) and the
transports (gloo, hetcomm's shm and gloo rails) are real. The emulation is torn down on exit,
also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from emulated_runs import run_in_emulation
from zipf_routing import ZIPF_S, expert_ffn, zipf_gate_weight, zipf_input, zipf_probs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_CLUSTER = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
WORLD_SIZE = 4
K = 2
CAPACITY_FACTOR = 1.25
VARIANTS = (
    "deepspeed",
    "hetcomm",
    "hetcomm plan=hier",
    "hetcomm plan=auto",
    "hetcomm -fp16",
    "hetcomm -rep",
    "hetcomm rep=always",
    "hetcomm bare",
)


@dataclass(frozen=True)
class LayerShape:
    """The one MoE layer both libraries run.

    Attributes:
        num_experts: ``E`` global experts (DeepSpeed: ``E / 4`` per rank).
        model_dim: ``D``; must be ``>= E + 1`` for the Zipf routing input.
        hidden_dim: ``F``, the expert FFN's hidden width.
        num_tokens: ``T`` tokens per rank per step.
    """

    num_experts: int
    model_dim: int
    hidden_dim: int
    num_tokens: int


# -- rank side -----------------------------------------------------------------------------------
class LinkBytes:
    """Counts the bytes this rank sends per link class through ``dist.all_to_all_single``."""

    def __init__(self, rank: int, cluster) -> None:
        import torch.distributed as dist

        self.classes = [cluster.link_class(rank, p).name for p in range(WORLD_SIZE)]
        self.rank = rank
        self.counts: dict[str, int] = {}
        self._orig = dist.all_to_all_single

        def counted(
            output,
            input,
            output_split_sizes=None,
            input_split_sizes=None,
            group=None,
            async_op=False,
        ):
            self._add(input, input_split_sizes)
            return self._orig(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
            )

        orig_all_reduce = dist.all_reduce

        def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            # Replica refresh and gradient sums go through the inner gloo, which hetcomm.stats()
            # does not see: count each call's tensor bytes (what every rank contributes).
            self.counts["all_reduce"] = (
                self.counts.get("all_reduce", 0) + tensor.numel() * tensor.element_size()
            )
            return orig_all_reduce(tensor, op=op, group=group, async_op=async_op)

        # Both libraries look the functions up on the module at call time, so this sees every call.
        dist.all_to_all_single = counted
        dist.all_reduce = counted_all_reduce

    def _add(self, t, splits) -> None:
        rows = t.shape[0] if t.dim() else 0
        if rows == 0:
            return
        row_bytes = t.numel() // rows * t.element_size()
        splits = list(splits) if splits else [rows // WORLD_SIZE] * WORLD_SIZE
        for p, n in enumerate(splits):
            if p != self.rank and n:
                self.counts[self.classes[p]] = (
                    self.counts.get(self.classes[p], 0) + int(n) * row_bytes
                )

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out



def _rank_main(args) -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if world != WORLD_SIZE:
        print(
            f"moe_emulated: rank {rank}: WORLD_SIZE={world}, this benchmark needs {WORLD_SIZE} "
            f"(mixed-mini)",
            file=sys.stderr,
        )
        return 2
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist

    import hetcomm
    from hetcomm.backends import HetcommOptions
    from hetcomm.moe import MoELayer
    from hetcomm.topo.cluster import load_cluster

    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    import deepspeed
    from deepspeed.moe.layer import MoE

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timeout)
    cluster = load_cluster(os.environ["HETCOMM_CLUSTER"])
    groups = {
        plan: dist.new_group(backend="hetcomm", timeout=timeout, pg_options=HetcommOptions(plan=plan))
        for plan in ("flat", "hier", "auto")
    }
    g_flat, g_hier, g_auto = groups["flat"], groups["hier"], groups["auto"]
    counter = LinkBytes(rank, cluster)

    shape = LayerShape(args.num_experts, args.model_dim, args.hidden_dim, args.tokens)
    E, D, F, T = shape.num_experts, shape.model_dim, shape.hidden_dim, shape.num_tokens
    gen = torch.Generator().manual_seed(1000 + rank)
    x = zipf_input(T, E, D, gen)
    gate_w = zipf_gate_weight(E, D)

    def loss_of(y, l_aux):
        return y.float().square().mean() + 0.01 * l_aux

    layers: dict[str, Any] = {}
    steps: dict[str, Callable[[], dict[str, Any]]] = {}

    torch.manual_seed(7)
    ds = MoE(
        hidden_size=D,
        expert=expert_ffn(D, F),
        num_experts=E,
        ep_size=WORLD_SIZE,
        k=K,
        capacity_factor=CAPACITY_FACTOR,
    )
    ds.set_deepspeed_parallelism()
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(gate_w)
    layers["deepspeed"] = ds

    def ds_step() -> dict[str, Any]:
        y, l_aux, _ = ds(x.clone().requires_grad_(True))
        loss_of(y, l_aux).backward()
        return {}

    steps["deepspeed"] = ds_step

    def add_hetcomm(name: str, group, **options) -> None:
        layer = MoELayer(
            D,
            E,
            k=K,
            capacity_factor=CAPACITY_FACTOR,
            expert=expert_ffn(D, F),
            group=group,
            cluster=cluster,
            calibrate=False,
            replicate_every=1,
            **options,
        )
        with torch.no_grad():
            layer.gate.wg.weight.copy_(gate_w)
        layers[name] = layer

        def step() -> dict[str, Any]:
            y = layer(x.clone().requires_grad_(True))
            loss_of(y, layer.l_aux).backward()
            st = layer.step_stats()
            return {
                "overflow_rate": st["overflow_rate"],
                "local_fraction": st["local_fraction"],
                "fwd_a2a_bytes_sent": st["a2a_bytes_sent"],
                "replicas": len(st["replicas"]),
            }

        steps[name] = step

    profitable = {"replicate": True, "replicate_policy": "profitable"}
    add_hetcomm("hetcomm", g_flat, wire_dtype="auto", **profitable)
    add_hetcomm("hetcomm plan=hier", g_hier, wire_dtype="auto", **profitable)
    add_hetcomm("hetcomm plan=auto", g_auto, wire_dtype="auto", **profitable)
    add_hetcomm("hetcomm -fp16", g_flat, wire_dtype="fp32", **profitable)
    add_hetcomm("hetcomm -rep", g_flat, wire_dtype="auto", replicate=False)
    add_hetcomm("hetcomm rep=always", g_flat, wire_dtype="auto", replicate=True, replicate_policy="always")
    add_hetcomm("hetcomm bare", g_flat, wire_dtype="fp32", replicate=False)

    names = list(VARIANTS)
    opts = {n: torch.optim.SGD(layers[n].parameters(), lr=0.0) for n in names}
    rec: dict[str, dict[str, list[Any]]] = {
        n: {"step_s": [], "link_bytes": [], "rail_bytes": [], "stats": []} for n in names
    }
    with torch.no_grad():
        first = layers["hetcomm"].gate(x).topk_idx[:, 0]
    first_counts = torch.bincount(first, minlength=E).tolist()

    rounds = args.warmup + args.steps
    for rnd in range(rounds):
        order = [names[(i + rnd) % len(names)] for i in range(len(names))]
        for n in order:
            dist.barrier()
            counter.take()
            rails0 = hetcomm.stats()
            t0 = time.perf_counter()
            st = steps[n]()
            dt = time.perf_counter() - t0
            link = counter.take()
            rails1 = hetcomm.stats()
            slow = torch.tensor([dt])
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            opts[n].step()
            opts[n].zero_grad(set_to_none=True)
            if rnd >= args.warmup:
                rec[n]["step_s"].append(float(slow))
                rec[n]["link_bytes"].append(link)
                rec[n]["rail_bytes"].append(
                    {
                        r: rails1[r]["bytes_sent"] - rails0.get(r, {}).get("bytes_sent", 0)
                        for r in rails1
                    }
                )
                rec[n]["stats"].append(st)
        if rank == 0:
            done = (
                " ".join(f"{n}={1e3 * rec[n]['step_s'][-1]:.0f}ms" for n in names)
                if rnd >= args.warmup
                else ""
            )
            print(
                f"  round {rnd + 1}/{rounds}{' (warm-up)' if rnd < args.warmup else ''} {done}",
                file=sys.stderr,
                flush=True,
            )
    with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "node": os.environ.get("HETCOMM_EMULATE_NODE"),
                "device": cluster.rank(rank).device_name,
                "first_choice_counts": first_counts,
                "hot_experts": layers["hetcomm"].step_stats()["hot_experts"],
                "hot_experts_always": layers["hetcomm rep=always"].step_stats()["hot_experts"],
                # {expert: (bytes saved, bytes spent) per step}, as the profitable policy saw them
                "replication_decision": {
                    str(e): v for e, v in layers["hetcomm"].replicator.last_decision.items()
                },
                "variants": rec,
            },
            f,
        )
    dist.barrier()
    # Every result is on disk. Exit without tearing the groups down: on this machine a rank
    # sometimes aborts in teardown ("terminate called without an active exception", seen on the
    # 910B rank), which would fail a run whose measurements are complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- parent side ---------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """Host, CPUs, load average and date: what every table carries."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    return {
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": model,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "loadavg": os.getloadavg(),
    }


def summarize(runs: list[dict[int, Any]], shape: LayerShape) -> dict[str, Any]:
    """Per variant: median over runs of the per-run median step time; bytes per link class."""
    med = statistics.median
    rows: dict[str, dict[str, Any]] = {}
    for n in VARIANTS:
        per_run = [med(res[0]["variants"][n]["step_s"]) for res in runs]
        # Bytes per step summed over the 4 ranks, median over all timed steps of all runs.
        link_steps: list[dict[str, int]] = []
        rail_steps: list[dict[str, int]] = []
        for res in runs:
            for i in range(len(res[0]["variants"][n]["link_bytes"])):
                tot: dict[str, int] = {}
                rails: dict[str, int] = {}
                for r in range(WORLD_SIZE):
                    for c, b in res[r]["variants"][n]["link_bytes"][i].items():
                        tot[c] = tot.get(c, 0) + b
                    for c, b in res[r]["variants"][n]["rail_bytes"][i].items():
                        rails[c] = rails.get(c, 0) + b
                link_steps.append(tot)
                rail_steps.append(rails)
        classes = sorted({c for s in link_steps for c in s})
        rail_names = sorted({c for s in rail_steps for c in s})
        stats = [
            s
            for res in runs
            for r in range(WORLD_SIZE)
            for s in res[r]["variants"][n]["stats"]
            if s
        ]
        row = {
            "step_s": med(per_run),
            "run_medians_s": per_run,
            "link_bytes": {c: med([s.get(c, 0) for s in link_steps]) for c in classes},
            "rail_bytes": {c: med([s.get(c, 0) for s in rail_steps]) for c in rail_names},
        }
        if stats:
            row["overflow_rate"] = med([s["overflow_rate"] for s in stats])
            row["local_fraction"] = med([s["local_fraction"] for s in stats])
        rows[n] = row
    ds = rows["deepspeed"]["step_s"]
    full = rows["hetcomm"]["step_s"]
    for row in rows.values():
        row["speedup_vs_deepspeed"] = ds / row["step_s"]
        row["slowdown_vs_full"] = row["step_s"] / full
    counts = [
        sum(runs[0][r]["first_choice_counts"][e] for r in range(WORLD_SIZE))
        for e in range(shape.num_experts)
    ]
    want = zipf_probs(shape.num_experts).tolist()
    seen = [c / sum(counts) for c in counts]
    return {
        "rows": rows,
        "routing": {
            "top1_share": seen[0],
            "zipf_top1": want[0],
            "total_variation": sum(abs(a - b) for a, b in zip(seen, want)) / 2,
        },
        "hot_experts": runs[-1][0]["hot_experts"],
        "hot_experts_always": runs[-1][0]["hot_experts_always"],
        "replication_decision": runs[-1][0]["replication_decision"],
    }


def render(summary: dict[str, Any], args, before, after, versions) -> str:
    """The markdown table and the attribution lines."""
    rows = summary["rows"]
    classes = sorted({c for r in rows.values() for c in r["link_bytes"]} - {"all_reduce"}) + [
        "all_reduce"
    ]
    la0 = " / ".join(f"{v:.1f}" for v in before["loadavg"])
    la1 = " / ".join(f"{v:.1f}" for v in after["loadavg"])
    header = (
        f"Machine: `{before['host']}`, {before['nproc']} CPUs ({before['cpu']}), {before['date']} UTC; "
        f"load average (1/5/15 min) {la0} before, {la1} after. torch {versions['torch']}, deepspeed "
        f"{versions['deepspeed']}. Emulated `{os.path.basename(args.cluster)}` at scale {args.scale:g} "
        f"(200 Gb/s port -> {200e3 * args.scale:.0f} Mbit/s, bridge {100e3 * args.scale:.0f} Mbit/s); "
        f"device kinds are labels. E={args.num_experts} D={args.model_dim} F={args.hidden_dim}, "
        f"{args.tokens} tokens/rank, k={K}, capacity factor {CAPACITY_FACTOR}, Zipf({ZIPF_S}) routing; "
        f"{args.runs} runs x {args.steps} timed rounds (after {args.warmup} warm-up), step = max over "
        f"ranks; cell = median over runs of the run's median [range of run medians]."
    )
    byte_cols = [f"a2a KB/step {c}" if c != "all_reduce" else "all_reduce KB/step" for c in classes]
    lines = [
        header,
        "",
        "| variant | step ms | vs DeepSpeed | vs full hetcomm | "
        + " | ".join(byte_cols)
        + " | rail KB/step (hetcomm.stats) | dropped | local |",
        "|---|---|---|---|" + "---|" * len(classes) + "---|---|---|",
    ]
    for n, r in rows.items():
        rng = f"{min(r['run_medians_s']) * 1e3:.0f}-{max(r['run_medians_s']) * 1e3:.0f}"
        rails = ", ".join(f"{c} {b / 1e3:.0f}" for c, b in r["rail_bytes"].items() if b) or "-"
        link = " | ".join(f"{r['link_bytes'].get(c, 0) / 1e3:.0f}" for c in classes)
        if "overflow_rate" in r:
            tail = f"{rails} | {r['overflow_rate']:.1%} | {r['local_fraction']:.2f}"
        else:  # DeepSpeed: no hetcomm rails, no step_stats
            tail = "- | | "
        lines.append(
            f"| {n} | {r['step_s'] * 1e3:.0f} [{rng}] | {r['speedup_vs_deepspeed']:.2f}x | "
            f"{r['slowdown_vs_full']:.2f}x | {link} | {tail} |"
        )
    full = rows["hetcomm"]["speedup_vs_deepspeed"]
    lines.append("")
    lines.append(
        f"hetcomm / DeepSpeed = {full:.2f}x (target >= 2x: {'met' if full >= 2.0 else 'MISSED'})."
    )
    for n, what in (
        ("hetcomm -fp16", "FP16 wire across vendors"),
        ("hetcomm -rep", "hot-expert replication (profitable policy)"),
    ):
        lines.append(
            f"- {what}: turning it off alone makes the step {rows[n]['slowdown_vs_full']:.2f}x the full one."
        )
    for n, what in (
        ("hetcomm plan=hier", "the hierarchical plan"),
        ("hetcomm plan=auto", "the auto plan (cost model picks per exchange)"),
        ("hetcomm rep=always", 'replicating the top 3 whatever they cost (`replicate_policy="always"`)'),
        ("hetcomm bare", "FP32 wire and no replication (the layer alone)"),
    ):
        lines.append(f"- {what} instead: the step takes {rows[n]['slowdown_vs_full']:.2f}x the full one.")
    z = summary["routing"]
    lines.append(
        f"Routing check: expert 0 took {z['top1_share']:.1%} of first choices (Zipf: {z['zipf_top1']:.1%}), "
        f"total variation from Zipf({ZIPF_S}) {z['total_variation']:.3f}; hot set "
        f"{summary['hot_experts_always']} (rep=always), {summary['hot_experts']} (profitable)."
    )
    for e, (saved, spent) in sorted(summary["replication_decision"].items(), key=lambda kv: int(kv[0])):
        verdict = "replicated" if saved > spent else "not replicated"
        lines.append(
            f"- profitable policy, expert {e}: saves {saved / 1e3:.0f} KB/step of all-to-all, its "
            f"weight + gradient sync costs {spent / 1e3:.0f} KB/step: {verdict}."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cluster", default=DEFAULT_CLUSTER, help="cluster YAML (4 ranks)")
    ap.add_argument("--scale", type=float, default=1e-3, help="emulated link rate factor")
    ap.add_argument(
        "--runs", type=int, default=3, help="fresh rank processes one after another (>= 3)"
    )
    ap.add_argument(
        "--steps", type=int, default=4, help="timed rounds per run, every variant once per round"
    )
    ap.add_argument(
        "--warmup", type=int, default=2, help="untimed rounds first (>= 1: replication's hot set)"
    )
    ap.add_argument("--num-experts", type=int, default=16)
    ap.add_argument("--model-dim", type=int, default=256)
    ap.add_argument("--hidden-dim", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    ap.add_argument(
        "--worker-out", help=argparse.SUPPRESS
    )  # set by the parent for the rank processes
    args = ap.parse_args(argv)
    if args.worker_out:
        return _rank_main(args)
    if args.runs < 1 or args.steps < 1 or args.warmup < 1:
        ap.error("--runs and --steps must be >= 1, --warmup >= 1")
    if args.model_dim < args.num_experts + 1 or args.num_experts % WORLD_SIZE:
        ap.error(
            "need --model-dim >= --num-experts + 1 and --num-experts divisible by 4 (DeepSpeed ep_size=4)"
        )
    try:
        import deepspeed
    except ImportError as e:
        print(
            f"moe_emulated: deepspeed is not importable ({e}); run with .venv-bench/bin/python",
            file=sys.stderr,
        )
        return 2
    from hetcomm.errors import ConfigError, HetcommError
    from hetcomm.topo.cluster import load_cluster

    try:
        # Bad options fail here, before any namespace exists, not inside 4 ranks.
        if load_cluster(args.cluster).num_ranks != WORLD_SIZE:
            raise ConfigError(
                f"this benchmark needs a {WORLD_SIZE}-rank cluster YAML (mixed-mini); give --cluster",
                path=args.cluster,
            )
    except HetcommError as e:
        print(f"moe_emulated: {e}", file=sys.stderr)
        return 2
    import torch

    versions = {"torch": torch.__version__, "deepspeed": deepspeed.__version__}
    shape = LayerShape(args.num_experts, args.model_dim, args.hidden_dim, args.tokens)
    before = machine_info()
    t_start = time.monotonic()
    rc, runs = run_in_emulation(
        "moe_emulated", __file__, args,
        ("num_experts", "model_dim", "hidden_dim", "tokens", "steps", "warmup", "timeout"),
        WORLD_SIZE,
    )
    if rc != 0:
        return rc
    after = machine_info()
    summary = summarize(runs, shape)
    print(render(summary, args, before, after, versions))
    print(f"\n({time.monotonic() - t_start:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine_before": before,
                    "machine_after": after,
                    "versions": versions,
                    "args": vars(args),
                    "shape": asdict(shape),
                    "summary": summary,
                    "runs": runs,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
