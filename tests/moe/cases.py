"""Rank-side bodies of the distributed MoE tests (module level, so they pickle by reference).

Each function runs inside one spawned rank (``tests.backends.ranks.run_ranks``) and returns plain
numbers/tensors; the test process compares them, so a failure message shows every rank's values.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

D_MODEL = 16
NUM_TOKENS = 48


def shard(rank: int, num_tokens: int = NUM_TOKENS, dim: int = D_MODEL):
    """Rank ``rank``'s input ``[T, D]`` and upstream gradient ``[T, D]`` (deterministic)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(num_tokens, dim, generator=g), torch.randn(num_tokens, dim, generator=g)


def reference_grads(layer, world_size: int, k: int, capacity_factor, num_tokens: int = NUM_TOKENS):
    """Reference outputs/grads for every shard, from the layer's own initial weights."""
    from hetcomm.moe.experts import build_expert
    from tests.moe.reference import reference_moe

    cfg = layer.config
    experts = [build_expert(layer._expert_spec, cfg.model_dim, e, cfg.seed) for e in range(cfg.num_experts)]
    res = []
    for s in range(world_size):
        x, gy = shard(s, num_tokens, cfg.model_dim)
        x.requires_grad_(True)
        gw = layer.gate.wg.weight.detach().clone().requires_grad_(True)
        y, l_aux, dropped = reference_moe(x, gw, experts, k, capacity_factor)
        ((y * gy).sum() + 0.01 * l_aux).backward()
        res.append({"y": y.detach(), "x_grad": x.grad, "gate_grad": gw.grad, "dropped": dropped})
    expert_grads = {e: [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()] for e, m in enumerate(experts)}
    return res, expert_grads


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def equivalence(rank: int, world_size: int, cases: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """For each case, run MoELayer fwd+bwd on this rank's shard and compare with the reference."""
    from hetcomm.moe import MoELayer

    out: Dict[str, Dict[str, float]] = {}
    outputs: Dict[str, torch.Tensor] = {}
    for case in cases:
        name = case["name"]
        kw = dict(case.get("kwargs", {}))
        E = case.get("num_experts", 8)
        k = case.get("k", 2)
        cf = case.get("capacity_factor", 1.25)
        layer = MoELayer(D_MODEL, E, k=k, capacity_factor=cf, calibrate=False, **kw)
        layer.train()
        x, gy = shard(rank)
        x.requires_grad_(True)
        y = layer(x)
        ((y * gy).sum() + 0.01 * layer.l_aux).backward()
        ref, ref_expert_grads = reference_grads(layer, world_size, k, None if kw.get("dropless") else cf)
        r = ref[rank]
        err_expert = 0.0
        for i, e in enumerate(layer.local_expert_ids):
            for p, q in zip(layer.experts.experts[i].parameters(), ref_expert_grads[e]):
                err_expert = max(err_expert, _max_err(p.grad if p.grad is not None else torch.zeros_like(p), q))
        out[name] = {
            "out": _max_err(y.detach(), r["y"]),
            "out_scale": float(r["y"].abs().max()),
            "x_grad": _max_err(x.grad, r["x_grad"]),
            "gate_grad": _max_err(layer.gate.wg.weight.grad, r["gate_grad"]),
            "expert_grad": err_expert,
            "dropped": layer.last_stats["dropped"],
            "ref_dropped": r["dropped"],
            "num_local_experts": len(layer.local_expert_ids),
            "bytes_sent": layer.last_stats["a2a_bytes_sent"],
        }
        outputs[name] = y.detach()
    # Error of a lossy wire against the FP32 wire of the same layer, same input.
    for name, y in outputs.items():
        base = cases[0]["name"]
        out[name]["vs_first_case"] = _max_err(y, outputs[base])
    return out


def zipf_gate_input(num_tokens: int, num_experts: int, dim: int, s: float, seed: int):
    """Inputs whose gate logits are ``log p_e + Gumbel``: top-k picks follow Zipf(s) routing.

    Feature 0 is constant 1, features ``1..E`` are i.i.d. Gumbel noise; with gate weight
    ``[log p | I_E | 0]`` the logits are exactly ``log p_e + G_{t,e}``, so each token's top-k is
    a Zipf(s) sample without replacement (the Gumbel-top-k trick).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, dim, generator=g) * 0.01
    x[:, 0] = 1.0
    u = torch.rand(num_tokens, num_experts, generator=g).clamp(1e-9, 1 - 1e-9)
    x[:, 1 : 1 + num_experts] = -torch.log(-torch.log(u))
    return x


def zipf_gate_weight(num_experts: int, dim: int, s: float) -> torch.Tensor:
    p = torch.arange(1, num_experts + 1, dtype=torch.float64) ** (-s)
    p = p / p.sum()
    w = torch.zeros(num_experts, dim)
    w[:, 0] = torch.log(p).float()
    w[:, 1 : 1 + num_experts] = torch.eye(num_experts)
    return w


def replication(rank: int, world_size: int, num_hot_list: List[int], steps: int = 3) -> Dict[str, Any]:
    """Replication vs none: outputs, training trajectory, replica equality, bytes per step."""
    from hetcomm.moe import MoELayer, counters, reset_counters

    E, D, T = 32, 48, 256
    res: Dict[str, Any] = {"bytes": {}}
    w = zipf_gate_weight(E, D, 1.2)

    def make(replicate: bool, num_hot: int, wire: str = "auto"):
        # speed_every=0: the prior's verdict holds from the start, so copies come after one step
        # (measured speeds would hold them until their verdict, at step 10).
        layer = MoELayer(
            D, E, k=2, dropless=True, calibrate=False, replicate=replicate, replicate_top=num_hot, wire_dtype=wire,
            replicate_every=1, speed_every=0, expert=lambda d: torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.GELU(), torch.nn.Linear(32, d)),
        )
        with torch.no_grad():
            layer.gate.wg.weight.copy_(w)
        layer.gate.wg.weight.requires_grad_(False)  # keep the routing Zipf throughout
        return layer

    # --- bytes per step: warm the hot set (1 step), then count one fwd+bwd step ------------
    for num_hot in [0] + list(num_hot_list):
        layer = make(num_hot > 0, max(num_hot, 1))
        x = zipf_gate_input(T, E, D, 1.2, seed=50 + rank)
        layer(x).sum().backward()  # step 1: observes the load, picks the hot set
        x2 = zipf_gate_input(T, E, D, 1.2, seed=90 + rank).requires_grad_(True)
        reset_counters()
        try:
            import hetcomm

            hetcomm.reset_stats()
        except Exception:
            pass
        y = layer(x2)
        y.sum().backward()
        c = counters()
        try:
            import hetcomm

            rails = hetcomm.stats()
        except Exception:
            rails = {}
        st = layer.step_stats()
        res["bytes"][num_hot] = {
            "a2a_bytes_sent": c["a2a_bytes_sent"],  # fwd + bwd, activations and their grads
            "fwd_bytes_sent": st["a2a_bytes_sent"],
            "fwd_bytes_without": st["a2a_bytes_sent_without_replication"],
            "local_fraction": st["local_fraction"],
            "extra_bytes": st["replica_extra_bytes"],
            "replicas": st["replicas"],
            "hot": st["hot_experts"],
            "rail_bytes_sent": sum(v.get("bytes_sent", 0) for v in rails.values()),
        }

    # --- identical outputs and identical training with and without replication -------------
    num_hot = num_hot_list[0]
    # FP32 wires here: replica gradients are summed apart from the owner's, so the owner's
    # parameters drift ~1e-8 from the twin's (float reassociation); over an FP16 wire that can
    # flip one FP16 rounding of a combined row (2.4e-4 at |y| ~ 0.5), which says nothing about
    # replication. The byte counts above use the cluster's wires (FP16 to the 910B).
    a, b = make(True, num_hot, "fp32"), make(False, num_hot, "fp32")
    opt_a = torch.optim.SGD([p for p in a.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD([p for p in b.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    max_out = max_param = 0.0
    for step in range(steps + 1):
        x = zipf_gate_input(T, E, D, 1.2, seed=200 + 10 * step + rank)
        ya, yb = a(x), b(x)
        max_out = max(max_out, float((ya - yb).detach().abs().max()))
        ya.square().mean().backward()
        yb.square().mean().backward()
        opt_a.step(); opt_b.step(); opt_a.zero_grad(); opt_b.zero_grad()
    for pa, pb in zip(a.experts.parameters(), b.experts.parameters()):
        max_param = max(max_param, float((pa - pb).detach().abs().max()))
    a.sync_replicas()
    # Replicas vs owners: every rank contributes its copies; compare through an all-reduce.
    hot = a.replicator.hot
    P = sum(p.numel() for p in a.experts.experts[0].parameters())
    owner_buf = torch.zeros(E, P)
    for i, e in enumerate(a.local_expert_ids):
        owner_buf[e] = torch.cat([p.detach().reshape(-1) for p in a.experts.experts[i].parameters()])
    dist.all_reduce(owner_buf)
    rep_err = 0.0
    for e, m in a.replicator.replicas.items():
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        rep_err = max(rep_err, float((flat - owner_buf[e]).abs().max()))
    res.update(
        out_diff=max_out,
        param_diff=max_param,
        replica_vs_owner=rep_err,
        num_replicas=len(a.replicator.replicas),
        hot=hot,
        strong=a.strong_ranks,
    )
    return res


def calibration_global(rank: int, world_size: int) -> Dict[str, Any]:
    """Calibrator history after a few steps with rank-dependent skew: must be identical."""
    from hetcomm.moe import MoELayer

    E, D = 16, 16
    layer = MoELayer(D, E, k=2, calibrate=True)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(32, D, generator=g) + rank  # each rank skews differently
        layer(x)
    return {"history": layer.gate.calibrator.history.clone(), "lag": layer.gate.calibrator.lag_factor()}


def one_rank_missing(rank: int, world_size: int, marks: str) -> str:
    """Rank 3 never calls the layer; the others must fail within the group timeout, not hang.
    Rank 3 stays alive (and away) until they are through (``marks``, see ``wait_done``)."""
    import time

    from hetcomm.moe import MoELayer
    from tests.backends.ranks import mark_done, wait_done

    layer = MoELayer(D_MODEL, 8, k=2, calibrate=False)
    if rank == 3:
        wait_done(marks, [0, 1, 2])
        return "skipped"
    t0 = time.time()
    try:
        layer(torch.randn(8, D_MODEL))
    except Exception as e:  # reported to the test, which checks the type and the message
        return f"{type(e).__name__} after {time.time() - t0:.1f}s: {e}"
    finally:
        mark_done(marks, rank)
    return "no error"


def wire_exchange(rank: int, world_size: int) -> Dict[str, Any]:
    """Exchange rows under the cluster's mixed policy (the Communicator's wire rule): per source
    peer, what arrived vs what was sent. FP32 pairs must be bit-exact, FP16 pairs exactly the
    FP16 rounding."""
    import hetcomm
    from hetcomm.backends.tokens.exchange import RowExchange
    from hetcomm.backends.tokens.wire import row_wires

    comm = hetcomm.communicator()
    wire = row_wires(comm, torch.float32, "auto")
    D = 5  # odd row width: segment sizes are not multiples of 8 bytes, padding is exercised

    def rows(src: int, dst: int) -> torch.Tensor:
        n = 1 + (src + 2 * dst) % 3
        g = torch.Generator().manual_seed(100 * src + dst)
        return torch.randn(n, D, generator=g, dtype=torch.float64).float() * 1000 + 1 / 3

    send = torch.cat([rows(rank, d) for d in range(world_size)])
    send_rows = [rows(rank, d).size(0) for d in range(world_size)]
    recv_rows = [rows(s, rank).size(0) for s in range(world_size)]
    out = torch.empty(sum(recv_rows), D)
    ex = RowExchange(comm, send_rows, recv_rows, wire, torch.float32, D, "wire-test")
    ex.start(send, None, out)
    ex.wait()
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    res = {}
    row = 0
    for s in range(world_size):
        n = recv_rows[s]
        expect = rows(s, rank)
        got = out[row : row + n]
        res[s] = {
            "wire": names[wire[s]] if s != rank else "self",
            "exact": bool(torch.equal(got, expect)),
            "fp16_rounded": bool(torch.equal(got, expect.half().float())),
        }
        row += n
    return res


def rebalance(rank: int, world_size: int) -> Dict[str, Any]:
    """Migrate experts mid-training (cold ones to the weak rank); compare with a twin that did not."""
    from hetcomm.moe import MoELayer

    E, D, T = 16, 24, 96

    def make():
        # FP32 wire: with the cluster policy, moving an expert off the 910B would also change
        # the dtype its tokens travel in, and the twins would differ by FP16 rounding.
        return MoELayer(D, E, k=2, dropless=True, calibrate=False, wire_dtype="fp32",
                        expert=lambda d: torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.GELU(), torch.nn.Linear(16, d)))

    a, b = make(), make()
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)

    def step(i: int):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(10 * i + rank))
        ya, yb = a(x), b(x)
        ya.square().mean().backward()
        yb.square().mean().backward()
        opt_a.step(); opt_b.step(); opt_a.zero_grad(); opt_b.zero_grad()
        return float((ya - yb).detach().abs().max())

    diffs = [step(i) for i in range(2)]
    before = list(a.local_expert_ids)
    load = [float(e) for e in range(E)]  # expert 15 hottest, expert 0 coldest
    moved = a.rebalance(load, opt_a)
    diffs += [step(i) for i in range(2, 5)]

    def by_id(layer):
        P = sum(p.numel() for p in layer.experts.experts[0].parameters())
        buf = torch.zeros(E, P, dtype=torch.float64)
        for i, e in enumerate(layer.local_expert_ids):
            buf[e] = torch.cat([p.detach().reshape(-1).double() for p in layer.experts.experts[i].parameters()])
        dist.all_reduce(buf)
        return buf

    return {
        "before": before,
        "after": list(a.local_expert_ids),
        "moved": moved,
        "out_diff": max(diffs),
        "param_diff": float((by_id(a) - by_id(b)).abs().max()),
    }


def subgroups(rank: int, world_size: int) -> Dict[str, Any]:
    """MoELayer over sub-groups {0,1} (two A100) and {2,3} (H800 + 910B) of the 4 ranks."""
    from hetcomm.moe import MoELayer

    # gloo sub-groups: the hetcomm backend (at the time of writing) refuses a sub-group when
    # HETCOMM_CLUSTER names a 4-rank cluster ("cluster has 4 ranks but the job has 2").
    g01 = dist.new_group([0, 1], backend="gloo")
    g23 = dist.new_group([2, 3], backend="gloo")
    mine = g01 if rank < 2 else g23
    sub_rank = dist.get_rank(mine)
    res = equivalence(sub_rank, 2, [{"name": "sub", "kwargs": {"group": mine, "wire_dtype": "fp32"}}])["sub"]
    layer = MoELayer(D_MODEL, 8, group=mine)  # wire from the cluster, by *global* rank pairs
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    res["auto_wire"] = names[layer.wire_dtype(1 - sub_rank)]
    res["strong"] = layer.strong_ranks
    return res


def frozen_gate_idle_rank(rank: int, world_size: int) -> Dict[str, Any]:
    """A frozen gate sends every token to rank 0's experts and the input needs no gradient (the
    first layer of a model over frozen embeddings): rank 1's experts get no rows, and its output
    must still join the backward that rank 0's combine-backward exchanges with it."""
    from hetcomm.moe import MoELayer

    D, E, T = 8, 4, 16  # experts 0, 1 on rank 0; 2, 3 on rank 1
    layer = MoELayer(D, E, k=2, dropless=True, calibrate=False, wire_dtype="fp32")
    with torch.no_grad():
        layer.gate.wg.weight.zero_()
        layer.gate.wg.weight[0:2] = 1.0  # positive inputs pick experts 0 and 1
    layer.gate.wg.weight.requires_grad_(False)
    x = torch.rand(T, D, generator=torch.Generator().manual_seed(rank)) + 0.1
    out = layer(x)
    flag = torch.tensor([1.0 if out.requires_grad else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    res: Dict[str, Any] = {"requires_grad": out.requires_grad, "rows": sum(layer.step_stats()["rows_per_expert"])}
    if flag.item() == 1.0:  # every rank can run the backward (else it would hang on the one that cannot)
        out.square().mean().backward()
        res["expert_grad"] = sum(float(p.grad.abs().sum()) for p in layer.experts.parameters() if p.grad is not None)
    return res
