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
hetcomm without and hetcomm with hot-expert replication (top 3 experts on every rank); the gate
is biased as :func:`zipf_gate_weight` explains and the run checks the first choices it got.
``--diagnose`` adds hetcomm with 2-chunk pipelining and with the backend's split check off;
``--profile N`` then times N more steps of each layer phase by phase (gate, route, all-to-all,
experts, combine; forward and backward) without changing either library.

Every step is forward + backward of ``mean(y^2) + 0.01 * l_aux`` on 4,096 tokens of width D per
rank (input requires grad), timed from a barrier to the end of backward on each rank; the step
time is the slowest rank's. After every step (untimed) an SGD step with lr=0 bumps the weights'
versions without changing them: replication then pays its per-step replica refresh as it would
in training, while routing stays stationary. Reported: median over the timed steps, tokens/s per
rank = 4096 / median step time, and the ratios. ``--upstream given`` replaces the loss by a fixed
upstream gradient (``torch.autograd.backward(y, dy)``, and for the floor one per expert output):
the step is then the layer's forward + backward alone, without the loss's ``[4096, D]``
temporaries, which the MoE layers pay and the floor (16 small outputs) does not.

    .venv-bench/bin/python benchmarks/moe_vs_deepspeed.py --config all --zipf
    .venv-bench/bin/python benchmarks/moe_vs_deepspeed.py --config fine --steps 3 --tokens 1024

Needs deepspeed (``.venv-bench``: torch 2.13.0 + deepspeed 0.19.8 + hetcomm editable); runs on CPU
with ``DS_ACCELERATOR=cpu``. All ranks are CPU processes on one host: no device kind is
emulated, the transports (hetcomm's shm rail, gloo) are real.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Dict, List, Optional

from zipf_routing import ZIPF_S, expert_ffn, zipf_gate_weight, zipf_input, zipf_probs

WORLD_SIZE = 4
K = 2
CAPACITY_FACTOR = 1.25


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


# Targets of issue 10 (token dispatch); issue 5's were 1.0x / 0.9x and 1.6x / 0.8x.
CONFIGS = {
    "coarse": BenchConfig("coarse", 8, 512, 2048, 1.2, 0.95),
    "fine": BenchConfig("fine", 64, 1024, 256, 1.8, 0.85),
}


# -- rank side -----------------------------------------------------------------------------------
class _Variant:
    """One timed thing: ``forward()`` returns the loss to run backward on (None: idle rank)."""

    def __init__(self, name: str, kind: str, forward: Callable[[], Any], params=None, *,
                 stats: Optional[Callable[[], Dict[str, Any]]] = None, module=None, timed_ranks=None):
        self.name = name
        self.kind = kind  # deepspeed | hetcomm | floor
        self.forward = forward
        self.params = list(params or [])
        self.stats = stats or (lambda: {})
        self.module = module
        self.timed_ranks = timed_ranks  # None: all ranks work
        self.first_choice_counts: Optional[List[int]] = None

    def step(self) -> Dict[str, Any]:
        """Forward + backward once; the variant's stats of that step."""
        _backward(self.forward())
        return self.stats()


def _backward(loss) -> None:
    """``loss.backward()``, or ``torch.autograd.backward(outputs, grads)`` for ``(outputs, grads)``
    (``--upstream given``); None: an idle rank."""
    if loss is None:
        return
    if isinstance(loss, tuple):
        import torch

        torch.autograd.backward(loss[0], loss[1])
    else:
        loss.backward()


def _build_variants(cfg: BenchConfig, args, rank: int, hgroup, hgroup_nocheck=None) -> List[_Variant]:
    import torch
    from deepspeed.moe.layer import MoE

    from hetcomm.moe import MoELayer, expert_capacity

    E, D, F, T = cfg.num_experts, cfg.model_dim, cfg.hidden_dim, args.tokens
    L = E // WORLD_SIZE
    g = torch.Generator().manual_seed(1000 + rank)
    x_plain = torch.randn(T, D, generator=g)
    x_zipf = zipf_input(T, E, D, g) if args.zipf else None

    given = args.upstream == "given"
    dy = torch.randn(T, D, generator=g) * 1e-3 if given else None  # fixed upstream gradient
    l_aux_grad = torch.tensor(0.01)

    def loss_of(y, l_aux):
        if given:
            return [y, l_aux], [dy, l_aux_grad]
        return y.float().square().mean() + 0.01 * l_aux

    out: List[_Variant] = []

    def add_deepspeed(name: str, x, zipf: bool) -> None:
        torch.manual_seed(7)
        moe = MoE(hidden_size=D, expert=expert_ffn(D, F), num_experts=E, ep_size=WORLD_SIZE, k=K,
                  capacity_factor=CAPACITY_FACTOR)
        moe.set_deepspeed_parallelism()
        if zipf:
            with torch.no_grad():
                moe.deepspeed_moe.gate.wg.weight.copy_(zipf_gate_weight(E, D))
        last: Dict[str, Any] = {}
        # DeepSpeed's capacity: ceil(T / E * 2 * capacity_factor), at least min_capacity=4; the
        # same formula as hetcomm's, so the same number of copies is dropped for the same picks.
        capacity = max(4, expert_capacity(T, E, K, CAPACITY_FACTOR))

        def forward():
            xi = x.detach().requires_grad_(True)  # a fresh leaf, no copy
            y, l_aux, exp_counts = moe(xi)
            last["exp_counts"] = exp_counts
            return loss_of(y, l_aux)

        def stats() -> Dict[str, Any]:
            counts = last["exp_counts"]
            return {"overflow_rate": float((counts - capacity).clamp_min(0).sum()) / (T * K)}

        out.append(_Variant(name, "deepspeed", forward, moe.parameters(), stats=stats, module=moe))

    def add_hetcomm(name: str, x, zipf: bool, group=None, **options) -> None:
        layer = MoELayer(D, E, k=K, capacity_factor=CAPACITY_FACTOR, expert=expert_ffn(D, F), group=group or hgroup,
                         wire_dtype="fp32", calibrate=False, **options)
        if zipf:
            with torch.no_grad():
                layer.gate.wg.weight.copy_(zipf_gate_weight(E, D))

        def forward():
            xi = x.detach().requires_grad_(True)  # a fresh leaf, no copy
            return loss_of(layer(xi), layer.l_aux)

        def stats() -> Dict[str, Any]:
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

        out.append(_Variant(name, "hetcomm", forward, layer.parameters(), stats=stats, module=layer))

    def add_floor(name: str, workers: int) -> None:
        torch.manual_seed(11)
        mods = [expert_ffn(D, F) for _ in range(L)]
        # 4096 tokens x k rows, spread as evenly as possible over this rank's E/4 experts.
        rows = [(T * K) // L + (1 if i < (T * K) % L else 0) for i in range(L)]
        xs = [torch.randn(n, D) for n in rows]

        dys = [torch.randn(n, D) * 1e-3 for n in rows] if given else None

        def forward():
            if rank >= workers:
                return None
            ys = [m(xx.detach().requires_grad_(True)) for m, xx in zip(mods, xs)]
            if given:
                return ys, dys
            return sum(y.square().mean() for y in ys)

        params = [p for m in mods for p in m.parameters()]
        out.append(_Variant(name, "floor", forward, params, timed_ranks=workers))

    add_deepspeed("deepspeed", x_plain, False)
    add_hetcomm("hetcomm", x_plain, False)
    if args.diagnose:
        # What two hetcomm knobs are worth here: the pipelined dispatch (2 chunks) and the
        # backend's pre-flight split check (one small gloo all_gather per all-to-all).
        add_hetcomm("hetcomm C=2", x_plain, False, num_chunks=2)
        add_hetcomm("hetcomm no split check", x_plain, False, group=hgroup_nocheck)
    add_floor("floor x4", 4)
    add_floor("floor x2", 2)
    if args.zipf:
        add_deepspeed("deepspeed zipf", x_zipf, True)
        add_hetcomm("hetcomm zipf", x_zipf, True)
        # Check that the routing is what the table says: first choices of this rank's tokens.
        with torch.no_grad():
            first = out[-1].module.gate(x_zipf).topk_idx[:, 0]
        out[-1].first_choice_counts = torch.bincount(first, minlength=E).tolist()
        # Hot set re-chosen every step from the EMA (it settles after the warm-up and then stays;
        # only a change of the set moves weights); replicas on every rank (no cluster file:
        # all ranks count as strong).
        add_hetcomm("hetcomm zipf +rep", x_zipf, True, replicate=True, replicate_every=1)
    return out



# -- per-phase profile (--profile) ---------------------------------------------------------------
class _PhaseClock:
    """Adds wall and CPU seconds per ``"<stage> <phase>"`` while wrappers and hooks fire.

    CPU seconds are this process's (``time.process_time``: every thread, hetcomm's rail threads
    included); on a shared machine they say what a phase costs whatever the load.
    """

    def __init__(self) -> None:
        self.stage = "fwd"
        self.wall: Dict[str, float] = {}
        self.cpu: Dict[str, float] = {}
        self._undo: List[Callable[[], None]] = []
        self._open: Dict[int, Any] = {}

    def reset(self) -> None:
        self.wall, self.cpu = {}, {}

    def add(self, phase: str, wall: float, cpu: float) -> None:
        key = f"{self.stage} {phase}"
        self.wall[key] = self.wall.get(key, 0.0) + wall
        self.cpu[key] = self.cpu.get(key, 0.0) + cpu

    def _timed(self, fn: Callable, phase: str) -> Callable:
        def timed(*a, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(phase, time.perf_counter() - t0, time.process_time() - c0)

        return timed

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        """Time every call of ``owner.attr`` (a module-level function, a module's method, or a
        static method of a class)."""
        import torch

        fn = getattr(owner, attr)
        raw = vars(owner).get(attr) if isinstance(owner, type) else None  # staticmethod object
        setattr(owner, attr, self._timed(fn, phase))
        if isinstance(owner, torch.nn.Module):
            self._undo.append(lambda: delattr(owner, attr))  # unhide the class's method
        elif raw is not None:
            self._undo.append(lambda: setattr(owner, attr, raw))
        else:
            self._undo.append(lambda: setattr(owner, attr, fn))

    def wrap_apply(self, module: Any, cls_name: str, phase: str) -> None:
        """Time ``module.<cls_name>.apply`` (an autograd Function, forward and backward use)."""
        cls = getattr(module, cls_name)
        timed = self._timed(cls.apply, phase)

        class _Shim:
            apply = staticmethod(timed)

        setattr(module, cls_name, _Shim)
        self._undo.append(lambda: setattr(module, cls_name, cls))

    def time_backward_of(self, modules, phase: str) -> None:
        """Time each module's backward: from its output grads' arrival to its input grads'."""
        for m in modules:
            def pre(mod, grad_output):
                self._open[id(mod)] = (time.perf_counter(), time.process_time())

            def post(mod, grad_input, grad_output):
                start = self._open.pop(id(mod), None)
                if start is not None:
                    self.add(phase, time.perf_counter() - start[0], time.process_time() - start[1])

            h1 = m.register_full_backward_pre_hook(pre)
            h2 = m.register_full_backward_hook(post)
            self._undo.append(h1.remove)
            self._undo.append(h2.remove)

    def undo(self) -> None:
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()


def _profile_variant(v: _Variant, steps: int) -> Dict[str, Any]:
    """Per-phase wall and CPU seconds of one step of ``v`` on this rank (median over ``steps``).

    Phases are timed by wrapping the functions each layer calls (hetcomm: gate, ``route_tokens``,
    ``hetcomm.backends.tokens.deepep.dispatch``/``combine`` (their backwards included),
    ``ExpertBank.forward_pieces``/``forward_blocks``; DeepSpeed: gate,
    ``_route_slots``/``_sparse_encode``, ``_AllToAll``, experts, ``_sparse_decode`` in
    ``deepspeed.moe.sharded_moe``) and, in backward, by hooks on every expert module and on the
    all-to-all's backward. ``rest`` is the stage's total minus the named phases (autograd
    bookkeeping, the loss, the gradients of the gate, the gathers and the permutations). One
    more step under torch.profiler lists the top ops by self time. Nothing in either library is
    modified; the wrappers are removed afterwards.
    """
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    clock = _PhaseClock()
    m = v.module
    if v.kind == "hetcomm":
        import hetcomm.backends.tokens.deepep as TD
        import hetcomm.backends.tokens.flow as TF
        import hetcomm.moe.layer as L

        clock.wrap(m.gate, "forward", "gate")
        clock.wrap(L, "route_tokens", "route")
        # dispatch = counts + metadata + rows (and the expansion); combine = weighted sums +
        # the return exchange. Their backwards are the reverse exchanges.
        clock.wrap(TD, "dispatch", "dispatch")
        clock.wrap(TD, "combine", "combine")
        clock.wrap(m.experts, "forward_blocks", "experts")
        clock.wrap(m.experts, "forward_pieces", "experts")
        clock.wrap(TF.DispatchFn, "backward", "dispatch")
        clock.wrap(TF.CombineFn, "backward", "combine")
        experts = list(m.experts.experts) + (list(m.replicator.replicas.values()) if m.replicator else [])
    elif v.kind == "floor":
        experts = []  # nothing but expert math: the whole stage is its "experts" phase
    else:
        import deepspeed.moe.sharded_moe as S

        dm = m.deepspeed_moe
        clock.wrap(dm.gate, "forward", "gate")
        clock.wrap(S, "_route_slots", "route")
        clock.wrap(S, "_sparse_encode", "route")
        clock.wrap_apply(S, "_AllToAll", "a2a")
        clock.wrap(dm.experts, "forward", "experts")
        clock.wrap(S, "_sparse_decode", "combine")
        experts = list(dm.experts.deepspeed_experts)
    clock.time_backward_of(experts, "experts")

    per_step: List[Dict[str, Any]] = []
    top_ops: Dict[str, float] = {}
    try:
        for i in range(steps + 1):
            with_prof = i == steps  # the last step only: the profiler's overhead stays out of the clocks
            clock.reset()
            dist.barrier()
            prof = profile(activities=[ProfilerActivity.CPU]) if with_prof else None
            if prof is not None:
                prof.__enter__()
            marks = [(time.perf_counter(), time.process_time())]
            clock.stage = "fwd"
            loss = v.forward()
            marks.append((time.perf_counter(), time.process_time()))
            clock.stage = "bwd"
            _backward(loss)
            marks.append((time.perf_counter(), time.process_time()))
            if prof is not None:
                prof.__exit__(None, None, None)
                for ev in prof.key_averages():
                    if not ev.key.startswith(("autograd::", "ProfilerStep")):
                        top_ops[ev.key] = ev.self_cpu_time_total * 1e-6
            else:
                row: Dict[str, Any] = {}
                for j, stage in enumerate(("fwd", "bwd")):
                    wall = marks[j + 1][0] - marks[j][0]
                    cpu = marks[j + 1][1] - marks[j][1]
                    named = [k for k in clock.wall if k.startswith(stage + " ")]
                    for k in named:
                        row[k] = (clock.wall[k], clock.cpu[k])
                    rest = "experts" if v.kind == "floor" else "rest"
                    row[f"{stage} {rest}"] = (wall - sum(clock.wall[k] for k in named),
                                              cpu - sum(clock.cpu[k] for k in named))
                    row[f"{stage} total"] = (wall, cpu)
                row["step total"] = (marks[2][0] - marks[0][0], marks[2][1] - marks[0][1])
                per_step.append(row)
            for p in v.params:
                p.grad = None
    finally:
        clock.undo()
    keys = sorted({k for r in per_step for k in r})
    phases = {
        k: (statistics.median([r.get(k, (0.0, 0.0))[0] for r in per_step]),
            statistics.median([r.get(k, (0.0, 0.0))[1] for r in per_step]))
        for k in keys
    }
    top = sorted(top_ops.items(), key=lambda kv: -kv[1])[:12]
    return {"phases": phases, "top_ops": top}


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
    hgroup_nocheck = None
    if args.diagnose:
        from hetcomm.backends import HetcommOptions

        hgroup_nocheck = dist.new_group(backend="hetcomm", timeout=timeout,
                                        pg_options=HetcommOptions(check_splits=False))

    results: Dict[str, Any] = {}
    for cfg_name in args.configs:
        cfg = CONFIGS[cfg_name]
        variants = _build_variants(cfg, args, rank, hgroup, hgroup_nocheck)
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
                c0 = time.process_time()
                t0 = time.perf_counter()
                st = v.step()
                dt = time.perf_counter() - t0
                # CPU seconds of this process (all its threads: hetcomm's rail threads included).
                # Against the wall time it says whether a variant's extra time is work or waiting.
                st = dict(st, cpu_s=time.process_time() - c0)
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
        results[cfg.name] = {"times": times, "extra": extra,
                             "first_choice_counts": {v.name: v.first_choice_counts for v in variants if v.first_choice_counts}}
        if args.profile:
            results[cfg.name]["profile"] = {
                v.name: _profile_variant(v, args.profile) for v in variants if v.name in ("hetcomm", "deepspeed", "floor x4")
            }
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
    if args.malloc_reuse:
        # glibc serves every allocation above its mmap threshold with a fresh mapping and gives it
        # back on free, so each large temporary page-faults its memory in again (about 15 ms of
        # CPU per 32 MiB tensor here). These keep freed memory on the heap for reuse. glibc reads
        # them when a process starts: they apply to the spawned ranks, not to this process.
        os.environ["MALLOC_MMAP_MAX_"] = "0"
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(16 << 30)
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


def merge_runs(a: Dict[int, Any], b: Dict[int, Any]) -> Dict[int, Any]:
    """Append run ``b``'s timed steps (and stats) to run ``a``'s, per rank and variant."""
    for r in a:
        for cfg_name, res in a[r].items():
            other = b[r][cfg_name]
            for name in res["times"]:
                res["times"][name].extend(other["times"][name])
                res["extra"][name].extend(other["extra"][name])
            if other.get("profile"):
                res["profile"] = other["profile"]  # the last run's profile
    return a


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
            row = {"step_s": t * scale, "tokens_per_s": T / (t * scale), "steps": ts, "spread": (min(ts), max(ts)),
                   "kind": "deepspeed" if name.startswith("deepspeed") else "floor" if name.startswith("floor") else "hetcomm"}
            if row["kind"] == "deepspeed":
                from hetcomm.moe import expert_capacity

                row["padded_rows"] = WORLD_SIZE * cfg.num_experts // WORLD_SIZE * max(4, expert_capacity(T, cfg.num_experts, K, CAPACITY_FACTOR))
            workers = range(2) if name == "floor x2" else range(WORLD_SIZE)
            ex = [e for r in workers for e in results[r][cfg_name]["extra"][name] if e]
            for key in ("overflow_rate", "local_fraction", "a2a_bytes_sent", "comm_exposed_s", "expert_s", "forward_s", "cpu_s"):
                vals = [e[key] for e in ex if key in e]
                if vals:
                    row[key] = med(vals)
            # Expert rows each rank computed (received copies; local replicas not included):
            # the busiest rank paces every all-to-all. DeepSpeed computes 4 x C rows per local
            # expert on every rank, C = its capacity, whatever the routing.
            per_rank = [med([e["rows"] for e in results[r][cfg_name]["extra"][name] if "rows" in e] or [0])
                        for r in range(WORLD_SIZE)]
            if any(per_rank):
                row["rows_per_rank"] = per_rank
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
        routing = None
        if args.zipf:
            import torch

            counts = torch.tensor([results[r][cfg_name]["first_choice_counts"]["hetcomm zipf"] for r in range(WORLD_SIZE)]).sum(0)
            seen = counts.double() / counts.sum()
            want = zipf_probs(cfg.num_experts)
            routing = {
                "first_choice_top1_share": float(seen[0]),
                "zipf_top1_share": float(want[0]),
                "total_variation": float((seen - want).abs().sum() / 2),
            }
        het = rows["hetcomm"]
        summary[cfg_name] = {
            "zipf_routing_check": routing,
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
        f"{args.tokens} tokens/rank, k={K}, capacity factor {CAPACITY_FACTOR}, forward+backward "
        f"{'from a fixed upstream gradient (--upstream given)' if args.upstream == 'given' else 'of mean(y^2) + 0.01 l_aux'}, "
        f"{'glibc mmap off (--malloc-reuse), ' if args.malloc_reuse else ''}"
        f"median of {args.runs} run(s) x {args.steps} timed rounds (each after {args.warmup} warm-up rounds)."
    )
    for cfg_name, s in summary.items():
        c = s["config"]
        lines.append("")
        lines.append(
            f"**{cfg_name}** E={c['num_experts']} D={c['model_dim']} F={c['hidden_dim']} "
            f"(targets: >= {c['min_vs_deepspeed']}x DeepSpeed, >= {c['min_vs_floor']}x floor)"
        )
        lines.append("")
        lines.append("| variant | step ms (median) | min..max ms | tokens/s per rank | vs DeepSpeed | vs floor x4 | CPU s/rank | dropped | local | owned-expert rows r0/r1/r2/r3 |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for name, r in s["rows"].items():
            scale = 2.0 if name == "floor x2" else 1.0
            lo, hi = (x * scale for x in r["spread"])
            drop = f"{r['overflow_rate']:.1%}" if "overflow_rate" in r else ""
            loc = f"{r['local_fraction']:.2f}" if "local_fraction" in r else ""
            # Under Zipf routing capacity drops change how many rows are computed: a ratio to
            # the 8,192-row floor would not compare like with like.
            vs_floor = "" if "zipf" in name else f"{r['vs_floor']:.2f}x"
            if "rows_per_rank" in r:
                rows_txt = "/".join(f"{x:.0f}" for x in r["rows_per_rank"])
            elif r.get("kind") == "deepspeed":
                rows_txt = f"{r['padded_rows']} each (padded)"
            elif r.get("kind") == "floor":
                rows_txt = f"{args.tokens * K} each"
            else:
                rows_txt = ""
            lines.append(
                f"| {name} | {r['step_s'] * 1e3:.0f} | {lo * 1e3:.0f}..{hi * 1e3:.0f} | {r['tokens_per_s']:.0f} | "
                f"{r['vs_deepspeed']:.2f}x | {vs_floor} | {r.get('cpu_s', float('nan')):.2f} | {drop} | {loc} | {rows_txt} |"
            )
        het = s["rows"]["hetcomm"]
        lines.append("")
        lines.append(
            "step ms: forward + backward, slowest rank, median over timed rounds; floor x4: the same 4 "
            "processes doing nothing but the expert math (Linear+GELU+Linear on 8,192 rows each, no "
            "gate, routing or communication); floor x2: that work 2 processes at a time, scaled to 4 "
            "ranks on 2 cores; CPU s/rank: CPU seconds of a rank's process per step, all threads "
            "(communication included), median over ranks and rounds."
        )
        lines.append("")
        lines.append(
            f"hetcomm / DeepSpeed = {het['vs_deepspeed']:.2f}x ({'met' if s['target_vs_deepspeed_met'] else 'MISSED'}), "
            f"hetcomm / floor x4 = {het['vs_floor']:.2f}x ({'met' if s['target_vs_floor_met'] else 'MISSED'})."
        )
        rows = s["rows"]
        if all("cpu_s" in rows[n] for n in ("hetcomm", "deepspeed", "floor x4")):
            # Work per step, whatever share of the machine the run got: the load-robust view.
            c_het, c_ds, c_floor = (rows[n]["cpu_s"] for n in ("hetcomm", "deepspeed", "floor x4"))
            lines.append(
                f"By CPU time per step (steadier on a shared machine): hetcomm / DeepSpeed = "
                f"{c_ds / c_het:.2f}x, hetcomm / floor x4 = {c_floor / c_het:.2f}x."
            )
        z = s["zipf_routing_check"]
        if z:
            lines.append(
                f"Zipf routing check: expert 0 took {z['first_choice_top1_share']:.1%} of first choices "
                f"(Zipf({ZIPF_S}): {z['zipf_top1_share']:.1%}); total variation distance of the first-choice "
                f"distribution from Zipf({ZIPF_S}): {z['total_variation']:.3f}."
            )
    return "\n".join(lines)


_PHASE_ORDER = ["gate", "route", "counts a2a", "a2a", "dispatch", "permute", "experts", "combine", "rest", "total"]


def render_profile(results: Dict[int, Any], args, summary: Optional[Dict[str, Any]] = None) -> str:
    """Per-phase table, hetcomm beside DeepSpeed: ms per step, mean over the 4 ranks (min..max)."""
    lines = []
    for cfg_name in args.configs:
        profs = [results[r][cfg_name].get("profile") for r in range(WORLD_SIZE)]
        if not profs[0]:
            continue
        names = list(profs[0])
        keys = {k for p in profs for n in names for k in p[n]["phases"]}

        def rank_key(k: str):
            stage, _, phase = k.partition(" ")
            return ({"fwd": 0, "bwd": 1, "step": 2}[stage], _PHASE_ORDER.index(phase) if phase in _PHASE_ORDER else 99, k)

        lines.append("")
        lines.append(f"**where the time goes, {cfg_name}**: wall ms / CPU ms of this rank's process per step "
                     f"(median of {args.profile} steps on each rank, mean over the 4 ranks)")
        lines.append("")
        lines.append("| phase | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for k in sorted(keys, key=rank_key):
            cells = []
            for n in names:
                vals = [p[n]["phases"][k] for p in profs if k in p[n]["phases"]]
                if vals:
                    wall = sum(x[0] for x in vals) / len(vals) * 1e3
                    cpu = sum(x[1] for x in vals) / len(vals) * 1e3
                    cells.append(f"{wall:.0f} / {cpu:.0f}")
                else:
                    cells.append("")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        if "hetcomm" in names and "floor x4" in names:
            # The gap to the floor by CPU: hetcomm's own expert calls against the floor's, and
            # every other phase (what the floor does not do at all).
            def cpu(n: str, k: str) -> float:
                vals = [p[n]["phases"][k][1] for p in profs if k in p[n]["phases"]]
                return sum(vals) / len(vals) * 1e3 if vals else 0.0

            het_total, floor_total = cpu("hetcomm", "step total"), cpu("floor x4", "step total")
            het_exp = cpu("hetcomm", "fwd experts") + cpu("hetcomm", "bwd experts")
            others = sorted(((k, cpu("hetcomm", k)) for k in keys
                             if k.startswith(("fwd ", "bwd ")) and not k.endswith((" experts", " total"))),
                            key=lambda kv: -kv[1])
            lines.append("")
            lines.append(
                f"CPU ms per step and rank: hetcomm {het_total:.0f} = experts {het_exp:.0f} (the floor's "
                f"expert math: {floor_total:.0f}) + everything else {het_total - het_exp:.0f} ("
                + ", ".join(f"{k} {v:.0f}" for k, v in others if v >= 0.5) + "). floor / hetcomm by CPU = "
                f"{floor_total / het_total:.2f}x in these profiled steps"
                + (f" ({summary[cfg_name]['rows']['floor x4']['cpu_s'] / summary[cfg_name]['rows']['hetcomm']['cpu_s']:.2f}x "
                   f"in the timed rounds above)." if summary and "cpu_s" in summary[cfg_name]["rows"].get("floor x4", {})
                   and "cpu_s" in summary[cfg_name]["rows"].get("hetcomm", {}) else ".")
            )
        for n in names:
            if n.startswith("floor"):
                continue
            lines.append("")
            lines.append(f"{n}, top ops on rank 0 (self ms, one profiled step): "
                         + ", ".join(f"{op} {t * 1e3:.0f}" for op, t in profs[0][n]["top_ops"]))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["coarse", "fine", "all"], default="all")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds, every variant once per round (>= 5 for a table)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--runs", type=int, default=1,
                    help="fresh process groups one after another; medians are over all their timed steps")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (4096 for the table)")
    ap.add_argument("--zipf", action="store_true", help="add the Zipf(1.2)-routed variants, replication on and off")
    ap.add_argument("--upstream", choices=["mse", "given"], default="mse",
                    help="what backward starts from: the loss mean(y^2) + 0.01 l_aux (the table's "
                         "definition), or a fixed upstream gradient (the layer's fwd+bwd alone)")
    ap.add_argument("--json", metavar="PATH", help="also write every timing and the summary as JSON")
    ap.add_argument("--malloc-reuse", action="store_true",
                    help="run the ranks with glibc's mmap allocations off (freed memory is reused, no page faults)")
    ap.add_argument("--diagnose", action="store_true",
                    help="add hetcomm variants with 2-chunk pipelining and with the backend's split check off")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile N more steps of each layer per phase (profiler on: slower)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is given up")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.tokens < 1 or args.runs < 1:
        ap.error("--steps, --tokens and --runs must be >= 1, --warmup >= 0")
    if args.zipf and args.warmup < 1:
        ap.error("--zipf needs --warmup >= 1: replication picks its hot set from the first step's routing")
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
    results: Optional[Dict[int, Any]] = None
    for run in range(args.runs):
        if args.runs > 1:
            print(f"run {run + 1}/{args.runs}: fresh process group", file=sys.stderr, flush=True)
        res = run_group(args)
        if res is None:
            return 1
        results = res if results is None else merge_runs(results, res)
    assert results is not None
    after = machine_info()
    summary = summarize(results, args)
    print(render(summary, args, before, after, versions))
    if args.profile:
        print(render_profile(results, args, summary))
    print(f"\n({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine_before": before, "machine_after": after, "versions": versions,
                       "args": {k: v for k, v in vars(args).items()}, "summary": summary,
                       "profile": {r: {c: results[r][c].get("profile") for c in args.configs} for r in results}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
