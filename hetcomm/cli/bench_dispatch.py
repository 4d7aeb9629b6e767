"""``hetcomm bench dispatch``: dispatch and combine, forward and backward, over either face of the
token engine (``hetcomm.Communicator``'s DeepEP-shaped verbs, ``hetcomm.TokenSwitch``).

What DeepEP's tests and Mooncake's EP benchmark measure for an MoE communication library, on
real ranks (``--nprocs N`` local processes, like ``hetcomm bench alltoall``):

* every rank routes ``--tokens`` rows of ``--hidden`` features to ``--topk`` of ``--experts``
  experts (experts dealt to ranks in contiguous blocks), drawn by ``--routing``:
  ``uniform``; ``hot:N:P`` (the N first experts take a fraction P of the picks); ``zipf:S``
  (expert i picked with weight ``1/(i+1)**S``) — k distinct experts per token, a seeded draw;
* four timed phases per iteration, each a call of a face's public API: ``dispatch`` (forward),
  ``combine`` (forward), combine's backward (a dispatch of the output gradients) and dispatch's
  backward (a combine of the input gradients), with a barrier before every step; host timers on
  CPU, device events (``torch.cuda.Event``) on CUDA tensors;
* ``--face``: ``communicator`` (``Communicator.dispatch``/``combine``, the default),
  ``tokenswitch`` (``TokenSwitch.create_routing`` + ``dispatch`` as the dispatch phase,
  ``combine``; the flat layout, ``max_recv_tokens`` = the routing's own slots),
  ``tokenswitch-expert-major`` (the same in the expert_major layout: the communicator's rows),
  or several, comma-separated. Every face computes the same function, ``out[t] = sum_k w[t, k]
  * x[t]`` (identity experts): TokenSwitch's combine is unweighted, so its experts scale their
  rows by their gate weight inside the combine phase (as a user's MoE block over it does), where
  the communicator's weighted combine does it itself. The faces take turns inside every iteration
  (the order alternates), on the same routing, bytes and ranks; per face the *step* (the four
  phases, the slowest rank's per iteration) gets its median and spread, and each face its ratio
  to the first, also as the median of the per-iteration ratios (interleaved steps);
* per rank and phase: p50/p90/p99/p999 (nearest rank over the iterations) and the **logical
  bandwidth** as DeepEP defines it: the token-row bytes a rank receives (dispatch-shaped phases)
  or sends (combine-shaped phases) to or from *other* ranks, in their wire dtype, divided by the
  phase's median time; rows for this rank's own experts are counted apart (``local``), never in
  the bandwidth.

The bytes are computed from the routing, independently of the backend; the test
(``tests/cli/test_bench_dispatch.py``) checks them against ``hetcomm.stats()`` of the same run:
the rails' bytes over the timed iterations equal these row bytes plus the metadata bytes the
dispatch counters report. ``docs/BENCH.md`` has the table and the command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hetcomm.errors import UsageError

__all__ = ["DispatchBenchConfig", "add_dispatch_args", "routing_weights", "run_dispatch", "dispatch_rank_entry", "format_dispatch_table"]

PHASES = ("dispatch", "combine", "combine-backward", "dispatch-backward")
#: The faces of the token engine ``--face`` can time.
FACES = ("communicator", "tokenswitch", "tokenswitch-expert-major")
#: Phases shaped like a dispatch (rows travel to the experts' ranks): DeepEP counts the bytes a
#: rank receives; the combine-shaped ones count what it sends.
_RECEIVING = ("dispatch", "combine-backward")
#: Experts in all: far above any MoE layer's count, and bounded before any rank builds its
#: per-expert tables (a typo such as 100000000 is refused up front, not in torch.multinomial).
MAX_EXPERTS = 1 << 16
#: tokens x experts per rank: the routing draw's [tokens, experts] float64 table (512 MiB).
MAX_ROUTING_ELEMENTS = 1 << 26
_DTYPES = {"float": "float32", "float32": "float32", "fp32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "half": "float16", "fp16": "float16", "float16": "float16"}


@dataclass(frozen=True)
class DispatchBenchConfig:
    """One ``hetcomm bench dispatch`` run; identical on every rank."""

    tokens: int
    hidden: int
    topk: int
    experts: int
    routing: str
    wire_dtype: str
    dtype: str
    iters: int
    warmup_iters: int
    timeout_s: float
    cluster: Optional[str] = None
    seed: int = 0
    faces: Tuple[str, ...] = ("communicator",)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DispatchBenchConfig":
        doc = json.loads(text)
        doc["faces"] = tuple(doc.get("faces", ("communicator",)))
        return cls(**doc)


def add_dispatch_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``hetcomm bench dispatch`` (``--tokens``, ``-n``, ``-w``, ``--json``,
    ``--nprocs``, ``--cluster`` are shared with the other benchmarks)."""
    g = p.add_argument_group("dispatch (hetcomm bench dispatch)")
    g.add_argument("--hidden", type=int, default=1024, help="features per token row (default %(default)s)")
    g.add_argument("--topk", type=int, default=2, help="experts per token (default %(default)s)")
    g.add_argument("--experts", type=int, default=None, help="experts in all, dealt to ranks in blocks (default 2 per rank)")
    g.add_argument("--routing", default="uniform", help="uniform | hot:N:P (N experts take fraction P) | zipf:S (default uniform)")
    g.add_argument("--wire-dtype", default="exact", help="hetcomm wire dtype between vendors: exact, cluster, fp32, fp16, bf16 (default exact)")
    g.add_argument("--face", default="communicator",
                   help="which face(s) of the token engine to time, comma-separated and interleaved: communicator "
                        "(Communicator.dispatch/combine), tokenswitch (hetcomm.TokenSwitch, flat layout), "
                        "tokenswitch-expert-major (default communicator)")


def routing_weights(spec: str, num_experts: int) -> List[float]:
    """Relative pick weight of every expert for ``--routing spec``.

    Raises:
        UsageError: an unknown or malformed spec (names the flag and the forms).
    """
    forms = "uniform, hot:N:P (0 < N < experts, 0 < P < 1) or zipf:S (finite S >= 0)"
    parts = spec.split(":")
    try:
        if parts == ["uniform"]:
            return [1.0] * num_experts
        if parts[0] == "hot" and len(parts) == 3:
            n, frac = int(parts[1]), float(parts[2])
            if not (0 < n < num_experts and 0.0 < frac < 1.0):
                raise ValueError
            return [frac / n] * n + [(1.0 - frac) / (num_experts - n)] * (num_experts - n)
        if parts[0] == "zipf" and len(parts) == 2:
            s = float(parts[1])
            if not (s >= 0.0 and math.isfinite(s)):
                raise ValueError
            # (i + 1) ** -s underflows to 0.0 for a huge S where (i + 1) ** s overflowed
            # (OverflowError); config_from_args then names the experts left with a weight.
            return [(i + 1) ** -s for i in range(num_experts)]
    except ValueError:
        pass
    raise UsageError(f"--routing {spec!r}: expected {forms} with {num_experts} experts")


def config_from_args(args: argparse.Namespace, num_ranks: int) -> DispatchBenchConfig:
    """Validate the flags before any process starts (UsageError names the flag)."""
    experts = args.experts if args.experts is not None else 2 * num_ranks
    for flag, value, low in (("--tokens", args.tokens, 1), ("--hidden", args.hidden, 1), ("--topk", args.topk, 1),
                             ("--experts", experts, 1), ("-n/--iters", args.iters, 1), ("-w/--warmup_iters", args.warmup_iters, 0)):
        if value < low:
            raise UsageError(f"{flag} {value}: must be >= {low}")
    if not args.timeout > 0:
        raise UsageError(f"-T/--timeout {args.timeout}: must be > 0 seconds")
    if experts % num_ranks:
        raise UsageError(f"--experts {experts}: must be a multiple of the {num_ranks} ranks (experts are dealt in blocks)")
    if args.topk > experts:
        raise UsageError(f"--topk {args.topk}: more than the {experts} experts")
    if args.tokens * args.hidden > (1 << 28):
        raise UsageError(f"--tokens x --hidden = {args.tokens * args.hidden} elements per rank: at most 2**28 here")
    # Checked before the weights list is built: every rank draws its routing from a
    # [tokens, experts] float64 table (torch.multinomial, at most 2**24 categories).
    if experts > MAX_EXPERTS:
        raise UsageError(f"--experts {experts}: at most {MAX_EXPERTS} experts here (an MoE layer has hundreds); "
                         f"lower --experts")
    if args.tokens * experts > MAX_ROUTING_ELEMENTS:
        raise UsageError(f"--tokens x --experts = {args.tokens * experts} routing weights per rank: at most 2**26 here "
                         f"(each rank draws from a [tokens, experts] float64 table); lower --tokens or --experts")
    weights = routing_weights(args.routing, experts)
    picked = sum(1 for w in weights if w > 0.0)
    if picked < args.topk:
        raise UsageError(f"--routing {args.routing!r}: only {picked} of the {experts} experts keep a weight above 0 "
                         f"in float64, fewer than --topk {args.topk}; use a smaller zipf exponent")
    from hetcomm.backends.options import WIRE_DTYPES

    if args.wire_dtype not in WIRE_DTYPES:
        raise UsageError(f"--wire-dtype {args.wire_dtype!r}: choose from {', '.join(WIRE_DTYPES)}")
    faces = tuple(f.strip() for f in str(args.face).split(","))
    if not faces or any(f not in FACES for f in faces) or len(set(faces)) != len(faces):
        raise UsageError(f"--face {args.face!r}: a comma-separated list of distinct faces from {', '.join(FACES)}")
    dtype = _DTYPES.get(args.datatype)
    if dtype is None:
        raise UsageError(f"-d/--datatype {args.datatype!r}: dispatch moves float rows: float, bf16 or half")
    return DispatchBenchConfig(
        tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=experts, routing=args.routing,
        wire_dtype=args.wire_dtype, dtype=dtype, iters=args.iters, warmup_iters=args.warmup_iters,
        timeout_s=float(args.timeout), cluster=args.cluster, faces=faces,
    )


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    import math

    i = min(len(sorted_values) - 1, max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[i]


def _route(config: DispatchBenchConfig, rank: int, device):
    import torch

    g = torch.Generator().manual_seed(config.seed * 1000003 + rank)
    w = torch.tensor(routing_weights(config.routing, config.experts), dtype=torch.float64)
    idx = torch.multinomial(w.expand(config.tokens, -1), config.topk, replacement=False, generator=g)
    gate = torch.softmax(torch.randn(config.tokens, config.topk, generator=g), dim=1)
    x = torch.randn(config.tokens, config.hidden, generator=g).to(getattr(torch, config.dtype))
    return x.to(device), idx.to(device), gate.to(device)


def _logical_bytes(comm, config: DispatchBenchConfig, idx, expert_to_rank) -> Dict[str, Dict[str, int]]:
    """Token-row bytes this rank sends and receives per phase (other ranks) and locally, from
    the routing alone (a row goes once to each rank holding one of its experts)."""
    import torch
    import torch.distributed as dist

    from hetcomm.backends.tokens.wire import row_wires, segment_bytes

    n, me = comm.world_size, comm.rank
    dtype = getattr(torch, config.dtype)
    dest = expert_to_rank[idx]  # [T, k]
    rows_to = [int((dest == r).any(dim=1).sum()) for r in range(n)]
    rows_from = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(rows_from, torch.tensor(rows_to, dtype=torch.int64))
    rows_from_l = rows_from.tolist()
    wire = row_wires(comm, dtype)  # the engine's own rule and segment sizes: its counters agree
    sent = sum(segment_bytes(rows_to[p], config.hidden, wire[p]) for p in range(n) if p != me)
    recv = sum(segment_bytes(rows_from_l[p], config.hidden, wire[p]) for p in range(n) if p != me)
    local = rows_to[me] * config.hidden * dtype.itemsize
    out = {}
    for phase in PHASES:
        forward_shaped = phase in _RECEIVING
        out[phase] = {"send_bytes": sent if forward_shaped else recv, "recv_bytes": recv if forward_shaped else sent, "local_bytes": local}
    return out


def dispatch_rank_entry(payload: str, rank: int, world_size: int, store) -> Optional[Dict[str, Any]]:
    """:func:`hetcomm.cli._benchlib.launch_ranks` target: one rank of the benchmark."""
    import datetime

    import torch
    import torch.distributed as dist

    import hetcomm
    from hetcomm.backends import tokens
    from hetcomm.backends.options import HetcommOptions

    config = DispatchBenchConfig.from_json(payload)
    torch.set_num_threads(1)
    dist.init_process_group(
        "hetcomm", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=config.timeout_s), pg_options=HetcommOptions(wire_dtype=config.wire_dtype),
    )
    try:
        comm = hetcomm.communicator()
        device = torch.device("cpu")
        x, idx, gate = _route(config, rank, device)
        per_rank = config.experts // world_size
        expert_to_rank = torch.arange(config.experts, device=device) // per_rank
        logical = _logical_bytes(comm, config, idx, expert_to_rank)
        timer = _Timer(device)
        steps = {f: _face_step(f, comm, config, expert_to_rank) for f in config.faces}
        times: Dict[str, Dict[str, List[float]]] = {f: {p: [] for p in PHASES} for f in config.faces}
        cpu: Dict[str, List[float]] = {f: [] for f in config.faces}
        for it in range(config.warmup_iters + config.iters):
            timed = it >= config.warmup_iters
            if it == config.warmup_iters:  # the counters cover the timed iterations only
                dist.barrier()
                hetcomm.reset_stats()
                tokens.reset_counters()
            # Interleaved, the order alternating: drift and the first-after-barrier cost fall
            # on every face alike.
            for face in (config.faces if it % 2 == 0 else config.faces[::-1]):
                dist.barrier()
                c0 = time.process_time()  # this process's threads: the work, whatever the load
                durations, _, _ = steps[face](timer, x, idx, gate)
                if timed:
                    cpu[face].append(time.process_time() - c0)
                    for phase, d in zip(PHASES, durations):
                        times[face][phase].append(d)
        dist.barrier()
        stats = hetcomm.stats()
        rail_sent = sum(int(v.get("bytes_sent", 0)) for v in stats.values() if isinstance(v, dict))
        rail_recv = sum(int(v.get("bytes_received", 0)) for v in stats.values() if isinstance(v, dict))
        counters = tokens.counters()
        faces = {face: {"phases": _phase_stats(times[face], logical)} for face in config.faces}
        for face in config.faces:
            faces[face]["step_s"] = [sum(ds) for ds in zip(*(times[face][p] for p in PHASES))]
            faces[face]["cpu_s"] = cpu[face]
        mine = {"rank": rank, "phases": faces[config.faces[0]]["phases"], "faces": faces, "rail_bytes_sent": rail_sent,
                "rail_bytes_received": rail_recv, "dispatch_counters": counters}
        gathered: List[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        if rank != 0:
            return None
        from hetcomm.cli._bench_measure import machine_description

        return {"benchmark": "dispatch", "config": asdict(config), "num_ranks": world_size,
                "timing": timer.kind, "machine": machine_description(), "ranks": gathered,
                "faces": face_summary(config.faces, gathered)}
    finally:
        dist.destroy_process_group()


def _face_step(face: str, comm, config: DispatchBenchConfig, expert_to_rank):
    """``step(timer, x, idx, gate) -> ((dispatch, combine, combine-backward, dispatch-backward)
    seconds, out [T, H], grad of x [T, H])`` of one step over ``face``: every face computes
    ``out[t] = sum_k gate[t, k] * x[t]`` (the experts are the identity, weighted by their gate)
    and ``x``'s gradient under an all-ones output gradient."""
    import torch

    if face == "communicator":

        def step(timer, x, idx, gate):
            xg = x.detach().requires_grad_(True)
            t = timer.start()
            res = comm.dispatch(xg, idx, gate, expert_to_rank=expert_to_rank)
            d_dispatch = timer.stop(t)
            y = res.recv_x.detach().requires_grad_(True)
            t = timer.start()
            out = comm.combine(y, res.handle)
            d_combine = timer.stop(t)
            t = timer.start()
            (gy,) = torch.autograd.grad(out, y, torch.ones_like(out))
            d_cbwd = timer.stop(t)
            t = timer.start()
            (gx,) = torch.autograd.grad(res.recv_x, xg, gy)
            return (d_dispatch, d_combine, d_cbwd, timer.stop(t)), out.detach(), gx

        return step
    import hetcomm

    itemsize = getattr(torch, config.dtype).itemsize
    layout = "flat" if face == "tokenswitch" else "expert_major"
    # Room for any routing (a token reaches a rank at most once, an expert at most once); each
    # dispatch asks for exactly its routing's slots, so no face pays for zeroing unused rows.
    room = config.tokens * comm.world_size * (1 if layout == "flat" else config.topk)
    ts = hetcomm.TokenSwitch(comm.group, config.experts, config.tokens, room, config.hidden * itemsize)

    def step(timer, x, idx, gate):
        xg = x.detach().requires_grad_(True)
        t = timer.start()
        routing = ts.create_routing(idx, layout=layout)
        out_tokens, out_w, _i = ts.dispatch(routing, xg, gate, routing.num_recv_tokens)
        d_dispatch = timer.stop(t)
        y = out_tokens.detach().requires_grad_(True)
        t = timer.start()
        # The experts' gate weights: a slot's (flat: its local experts', 0 elsewhere) summed.
        w = out_w if out_w.dim() == 1 else out_w.sum(1)
        out = ts.combine(routing, y * w.unsqueeze(1).to(y.dtype))
        d_combine = timer.stop(t)
        t = timer.start()
        (gy,) = torch.autograd.grad(out, y, torch.ones_like(out))
        d_cbwd = timer.stop(t)
        t = timer.start()
        (gx,) = torch.autograd.grad(out_tokens, xg, gy)
        return (d_dispatch, d_combine, d_cbwd, timer.stop(t)), out.detach(), gx

    return step


def _phase_stats(times: Dict[str, List[float]], logical: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, float]]:
    """Per phase: the logical bytes, p50/p90/p99/p999 (us) and DeepEP's logical GB/s."""
    out = {}
    for phase in PHASES:
        s = sorted(times[phase])
        p50 = _percentile(s, 50)
        moved = logical[phase]["recv_bytes" if phase in _RECEIVING else "send_bytes"]
        out[phase] = dict(
            logical[phase], p50_us=p50 * 1e6, p90_us=_percentile(s, 90) * 1e6, p99_us=_percentile(s, 99) * 1e6,
            p999_us=_percentile(s, 99.9) * 1e6, logical_GBps=(moved / p50 / 1e9) if p50 > 0 else 0.0,
        )
    return out


def face_summary(faces: Sequence[str], ranks: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per face: the step (four phases) of the slowest rank per iteration, its p10/p50/p90 (us)
    and spread ((p90 - p10) / p50, %); the ratio of its p50 to the first face's and the median
    of the per-iteration ratios (interleaved pairs); the CPU seconds of a step summed over the
    ranks (every thread of every rank process: the work, which a loaded machine delays but does
    not change), its p50 and ratio likewise."""
    n = len(ranks[0]["faces"][faces[0]]["step_s"])
    per_face = {f: [max(r["faces"][f]["step_s"][i] for r in ranks) for i in range(n)] for f in faces}
    cpu = {f: [sum(r["faces"][f]["cpu_s"][i] for r in ranks) for i in range(n)] for f in faces}
    out: Dict[str, Dict[str, float]] = {}
    base = per_face[faces[0]]
    c50 = {f: _percentile(sorted(cpu[f]), 50) for f in faces}
    for f in faces:
        s = sorted(per_face[f])
        p10, p50, p90 = (_percentile(s, q) for q in (10, 50, 90))
        row = {"iterations": len(s), "step_p10_us": p10 * 1e6, "step_p50_us": p50 * 1e6, "step_p90_us": p90 * 1e6,
               "spread_pct": 100.0 * (p90 - p10) / p50 if p50 > 0 else 0.0}
        b50 = _percentile(sorted(base), 50)
        row["ratio_p50"] = p50 / b50 if b50 > 0 else 0.0
        pairs = sorted(a / b for a, b in zip(per_face[f], base) if b > 0)
        row["ratio_paired_median"] = _percentile(pairs, 50) if pairs else 0.0
        row["cpu_p50_us"] = c50[f] * 1e6
        row["cpu_ratio_p50"] = c50[f] / c50[faces[0]] if c50[faces[0]] > 0 else 0.0
        out[f] = row
    return out


class _Timer:
    """Host wall time on CPU; device events on CUDA (``elapsed_time`` after a synchronize of
    the event, so the host waits only at the end of each phase)."""

    def __init__(self, device):
        self.device = device
        self.kind = "cuda-events" if device.type == "cuda" else "host"

    def start(self):
        if self.device.type == "cuda":
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, started) -> float:
        if self.device.type == "cuda":
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            e.synchronize()
            return started.elapsed_time(e) / 1e3
        return time.perf_counter() - started


def format_dispatch_table(result: Dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"# hetcomm bench dispatch: {result['num_ranks']} ranks, tokens {c['tokens']} x hidden {c['hidden']} "
        f"{c['dtype']}, top-{c['topk']} of {c['experts']} experts, routing {c['routing']}, wire {c['wire_dtype']}, "
        f"{c['iters']} iterations ({result['timing']} timing)",
        "# bytes per rank per call: to/from other ranks (wire dtype), local rows apart; GB/s = DeepEP's logical",
        "# bandwidth (received bytes for dispatch-shaped phases, sent bytes for combine-shaped ones) / p50",
        "#  rank  face                      phase               send(MB)  recv(MB) local(MB)    p50(us)    p90(us)    p99(us)   p999(us)    GB/s",
    ]
    faces = c.get("faces") or ["communicator"]
    for r in result["ranks"]:
        for face in faces:
            for phase in PHASES:
                p = r["faces"][face]["phases"][phase]
                lines.append(
                    f"  {r['rank']:>5}  {face:<24} {phase:<18} {p['send_bytes'] / 1e6:>9.3f} {p['recv_bytes'] / 1e6:>9.3f} "
                    f"{p['local_bytes'] / 1e6:>9.3f} {p['p50_us']:>10.1f} {p['p90_us']:>10.1f} {p['p99_us']:>10.1f} "
                    f"{p['p999_us']:>10.1f} {p['logical_GBps']:>7.4f}"
                )
    summary = result["faces"]
    lines.append(f"# step = the four phases, the slowest rank's, per iteration ({summary[faces[0]]['iterations']} "
                 f"iterations{', faces interleaved' if len(faces) > 1 else ''}); spread = (p90 - p10) / p50")
    lines.append(f"# cpu = CPU time of a step, every thread of every rank; ratios: to {faces[0]}")
    lines.append("#  face                      step p50(us)   p10(us)   p90(us) spread(%) ratio p50 paired  cpu p50(us) cpu ratio")
    for face in faces:
        f = summary[face]
        lines.append(
            f"#  {face:<24} {f['step_p50_us']:>13.1f} {f['step_p10_us']:>9.1f} {f['step_p90_us']:>9.1f} "
            f"{f['spread_pct']:>9.1f} {f['ratio_p50']:>9.3f} {f['ratio_paired_median']:>6.3f} "
            f"{f['cpu_p50_us']:>12.1f} {f['cpu_ratio_p50']:>9.3f}"
        )
    return "\n".join(lines) + "\n"


def run_dispatch(args: argparse.Namespace, num_ranks: int) -> int:
    """``hetcomm bench dispatch``: validate, start the ranks, print the table or JSON."""
    from hetcomm.cli import _benchlib as lib
    from hetcomm.cli._bench_output import discard_output, open_output, write_output
    from hetcomm.cli.main import EXIT_FINDINGS, EXIT_OK, EXIT_TIMEOUT

    config = config_from_args(args, num_ranks)
    env = {"HETCOMM_CLUSTER": config.cluster} if config.cluster else {}
    out = open_output(args.output_file)  # an unwritable -J path fails before any rank starts
    try:
        print(f"hetcomm bench: starting {num_ranks} local ranks for dispatch/combine", file=sys.stderr, flush=True)
        outcome = lib.launch_ranks("hetcomm.cli.bench_dispatch:dispatch_rank_entry", config.to_json(), num_ranks,
                                   timeout_s=config.timeout_s, env=env)
    except BaseException:
        discard_output(out)
        raise
    if not outcome.ok:
        discard_output(out)
        for failure in outcome.failures:
            kind = f"{failure.error_type}: " if failure.error_type else ""
            print(f"hetcomm bench: error: rank {failure.rank} failed: {kind}{failure.message}", file=sys.stderr)
        return EXIT_TIMEOUT if outcome.failures[0].is_timeout else EXIT_FINDINGS
    text = json.dumps(outcome.result, indent=1) + "\n" if args.json else format_dispatch_table(outcome.result)
    sys.stdout.write(text)
    sys.stdout.flush()
    if out is not None:
        write_output(out, outcome.result)  # a full disk: one -J/--output_file line, exit 2
    return EXIT_OK
