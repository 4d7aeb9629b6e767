"""MoELayer on 4 real rank processes: pipelining overlap, wire dtypes, replication, vs the floor.

Every variant runs in the same spawned group, in turns within each round (so machine noise hits
all variants alike), for several rounds; the table reports medians over all timed steps.

    .venv/bin/python benchmarks/moe_layer.py                       # default: small config
    .venv/bin/python benchmarks/moe_layer.py --preset fine --steps 4

Columns:
    fwd+bwd ms        median wall time of one training step (forward + backward) on a rank,
                      slowest rank of the step
    tok/s/rank        tokens of one rank / that time
    exposed ms        forward time blocked waiting for the network (median)
    overlap           1 - exposed(C chunks) / exposed(1 chunk), same wire: share of the
                      one-chunk communication time that the pipeline hid behind expert compute
    a2a KiB/step      activation bytes this rank sent over the all-to-all, forward + backward
    local             share of kept token copies computed on the rank that routed them
    floor tok/s       the routed tokens' expert FFN forward+backward alone, on each rank (no
                      routing, no padding, no communication), measured in the same run

Ranks are CPU processes standing for the devices of configs/clusters/mixed-mini.yaml (2 A100,
1 H800, 1 910B: labels); the transports between them (hetcomm rails, or gloo) are real.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {
    "small": dict(experts=16, dim=512, ffn=512, tokens=1024),
    "fine": dict(experts=64, dim=1024, ffn=256, tokens=4096),
    "coarse": dict(experts=8, dim=512, ffn=2048, tokens=4096),
}


def variants(zipf: bool):
    v = [
        ("fp32 C=1", dict(wire_dtype="fp32", num_chunks=1)),
        ("fp32 C=2", dict(wire_dtype="fp32", num_chunks=2)),
        ("fp32 C=4", dict(wire_dtype="fp32", num_chunks=4)),
        ("auto C=1", dict(wire_dtype="auto", num_chunks=1)),
        ("auto C=2", dict(wire_dtype="auto", num_chunks=2)),
    ]
    if zipf:
        v += [
            ("zipf auto C=1", dict(wire_dtype="auto", num_chunks=1, zipf=True)),
            ("zipf auto C=1 +rep3", dict(wire_dtype="auto", num_chunks=1, zipf=True, replicate=True, replicate_top=3)),
            ("zipf auto C=1 +rep12", dict(wire_dtype="auto", num_chunks=1, zipf=True, replicate=True, replicate_top=12)),
        ]
    return v


def _zipf_weight(E: int, D: int) -> torch.Tensor:
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -1.2
    w = torch.zeros(E, D)
    w[:, 0] = torch.log(p / p.sum()).float()
    w[:, 1 : 1 + E] = torch.eye(E)
    return w


def _zipf_input(T: int, E: int, D: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(T, D, generator=g) * 0.01
    x[:, 0] = 1.0
    u = torch.rand(T, E, generator=g).clamp(1e-9, 1 - 1e-9)
    x[:, 1 : 1 + E] = -torch.log(-torch.log(u))
    return x


def _rank_main(rank, world, port, args, q):
    os.environ["HETCOMM_CLUSTER"] = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")
    torch.set_num_threads(1)
    import hetcomm  # noqa: F401  (registers the backend)
    from hetcomm.moe import FFNExpert, MoELayer, counters, reset_counters

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    E, D, F, T = args.experts, args.dim, args.ffn, args.tokens
    vs = variants(args.zipf)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        vs = [v for v in vs if v[0] in wanted]
    layers = []
    for name, kw in vs:
        kw = dict(kw)
        zipf = kw.pop("zipf", False)
        layer = MoELayer(D, E, k=2, capacity_factor=1.25, expert=lambda d: FFNExpert(d, F), calibrate=False,
                         dropless=zipf, replicate_every=1, strong_expert_weight=args.strong_weight, **kw)
        if zipf:
            with torch.no_grad():
                layer.gate.wg.weight.copy_(_zipf_weight(E, D))
        layers.append((name, layer, zipf))
    g = torch.Generator().manual_seed(rank)
    x_plain = torch.randn(T, D, generator=g)
    x_zipf = _zipf_input(T, E, D, g)
    res = {name: dict(step=[], exposed=[], bytes=[], local=[]) for name, _, _ in layers}
    floor = []
    for rnd in range(args.warmup + args.steps):
        for name, layer, zipf in layers:
            x = (x_zipf if zipf else x_plain).clone().requires_grad_(True)
            dist.barrier()
            reset_counters()
            t0 = time.perf_counter()
            y = layer(x)
            (y.float().square().mean() + 0.01 * layer.l_aux).backward()
            dt = time.perf_counter() - t0
            st = layer.step_stats()
            layer.zero_grad(set_to_none=True)
            if rnd >= args.warmup:
                slow = torch.tensor([dt])
                dist.all_reduce(slow, op=dist.ReduceOp.MAX)
                r = res[name]
                r["step"].append(float(slow))
                r["exposed"].append(st["comm_exposed_s"])
                r["bytes"].append(counters()["a2a_bytes_sent"])
                r["local"].append(st["local_fraction"])
        # Floor: exactly the rows this rank's experts computed in the first variant (FFN
        # forward + backward only: no routing, no padding, no communication).
        if rnd >= args.warmup:
            rows = layers[0][1].step_stats()["rows_per_expert"]
            mods = [FFNExpert(D, F) for _ in rows]
            xs = [torch.randn(n, D, requires_grad=True) for n in rows]
            dist.barrier()
            t0 = time.perf_counter()
            for m, xx in zip(mods, xs):
                if xx.size(0):
                    m(xx).square().mean().backward()
            slow = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            floor.append(float(slow))
    q.put((rank, res, floor))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--tokens", type=int, help="tokens per rank")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (every variant once per round)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--backend", default="hetcomm", choices=["hetcomm", "gloo"])
    ap.add_argument("--no-zipf", dest="zipf", action="store_false", help="skip the replication variants")
    ap.add_argument("--strong-weight", type=float, default=2.0,
                    help="experts on a strong rank per expert on a weak one (1.0: equal split, "
                         "fair when every rank is the same CPU)")
    ap.add_argument("--only", default="", help="comma-separated variant names, e.g. 'fp32 C=1,auto C=2'")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    world = 4
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, q)) for r in range(world)]
    t0 = time.time()
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + 3600
    while len(results) < world and time.time() < deadline:
        try:
            rank, res, floor = q.get(timeout=5)
            results[rank] = (res, floor)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                print("a rank failed; see its traceback above", file=sys.stderr)
                break
        print(f"\r... {time.time() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(results) < world:
        return 1
    res0 = results[0][0]
    names = list(res0)
    T = args.tokens
    med = statistics.median
    print(f"# MoELayer, 4 ranks ({args.backend}, mixed-mini labels), E={args.experts} D={args.dim} "
          f"F={args.ffn}, {T} tokens/rank, k=2, cf=1.25, fwd+bwd, strong_expert_weight={args.strong_weight}")
    print(f"# {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{datetime.now().strftime('%Y-%m-%d %H:%M')}, {args.steps} rounds after {args.warmup} warm-up")
    floor_s = med(results[0][1])
    print("| variant | fwd+bwd ms | tok/s/rank | exposed ms (r0..r3) | overlap | a2a KiB/step (r0..r3) | local (r0..r3) |")
    print("|---|---|---|---|---|---|---|")
    base_exposed = {}
    for name in names:
        step = med(res0[name]["step"])
        exposed = [med(results[r][0][name]["exposed"]) for r in range(world)]
        wire = name.split(" C=")[0]
        if name.endswith("C=1"):
            base_exposed[wire] = exposed
        ov = ""
        if " C=" in name and not name.endswith("C=1") and "+" not in name and wire in base_exposed:
            b = sum(base_exposed[wire])
            ov = f"{1 - sum(exposed) / b:.0%}" if b > 0 else ""
        kib = [med(results[r][0][name]["bytes"]) / 1024 for r in range(world)]
        loc = [med(results[r][0][name]["local"]) for r in range(world)]
        print(f"| {name} | {step * 1e3:.0f} | {T / step:.0f} | {' / '.join(f'{e * 1e3:.0f}' for e in exposed)} | {ov} | "
              f"{' / '.join(f'{k:.0f}' for k in kib)} | {' / '.join(f'{l:.2f}' for l in loc)} |")
    print(f"| floor (expert FFN only) | {floor_s * 1e3:.0f} | {T / floor_s:.0f} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
