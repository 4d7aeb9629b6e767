"""In-memory snapshots restored on another world size (hetcomm.ops.snapshot_reshard): 4 -> 3, 3 -> 4.

Real ranks of the tiny job (``train_worker`` on the test launcher), each node of the cluster with
a shared-memory root of its own:

1. the old job trains 12 steps with a snapshot every step and a DCP checkpoint every 4; its
   normal end is made to keep the snapshots, as a killed job leaves them;
2. shrink: the h800 node's memory is deleted (the node is lost for good) and the 3 remaining ranks
   restore from memory: old rank 2's state from its peer copy on the 910B node. Grow: the 4
   ranks of the returned node's job restore from the 3-rank job's memory, the h800 rank from
   its peers' snapshots alone;
3. the same new job resumes from the DCP checkpoint of the same step instead (DCP reshards);
4. (shrink) memory only: no checkpoint directory, so no ``membership.json``: the snapshots'
   headers carry the measured speeds (checked against the metrics' agreed vector), set here to
   speeds whose placement differs from the datasheet's, and the 3 ranks place by them; the
   change is recorded from the headers too (the metrics ``membership`` event, the health
   record, the summary row, its seconds said unknown).

Both new jobs place their experts alike (the same membership record), so DCP's reshard is the
reference: every rank's state right after the restore (dense weights, experts by global id,
AdamW state, data stream) is equal bit for bit, every expert is owned exactly once, and the
losses of the steps after are equal. The shrink runs the default balancing.

Below the loop (one MoE layer, the Snapshotter itself): 4 -> 3, and 4 -> 4 with the h800 node
replaced by a new one (another expert map: a reshard too) give the 4-rank layer's outputs and
every expert's Adam moments; a per-rank extra starts afresh, and comes back whole on the same
membership; another model is refused by every rank alike. Then the plan's pure parts: the step chosen, the holders, the requests.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hetcomm.ops.metrics import read_metrics
from tests.backends.ranks import MIXED_MINI, run_ranks
from tests.ops.jobs import TINY, _free_port, _train_rank

OLD_STEPS, NEW_STEPS, EVERY = 12, 16, 4
EXPERTS = 4  # tiny.yaml


def _rank(rank: int, world_size: int, cfg, port: int, root: str, job: str, keep: bool, out: str, launch: dict):
    """A rank of the tiny job whose node's snapshots live under ``root/<node>``; ``keep``: its
    end leaves them; ``out``: the state right after the restore goes to ``out/r<rank>.pt``;
    ``launch``: the launch identity (``hetcomm launch``'s variables): every run of one test is
    a restart of one launch, so the next run restores what the last one left."""
    import torch

    from hetcomm.ops import hooks
    from hetcomm.ops.checkpoint import TrainState, _state
    from hetcomm.topo.cluster import load_cluster

    os.environ["HETCOMM_SNAPSHOT_ROOT"] = os.path.join(root, load_cluster(cfg.cluster).rank(rank).node.name)
    os.environ["HETCOMM_JOB_ID"] = job
    os.environ.update(launch)
    if keep:
        def close(snap, mc, step, steps_run, elapsed_s):
            if snap is not None:
                snap.close(remove=False)
            return []

        hooks.close_snapshots = close
    if out:
        restore = hooks.restore

        def dump(cfg, model, optimizer, rng, extras, snap):
            step, what = restore(cfg, model, optimizer, rng, extras, snap)
            state = _state(model, optimizer, TrainState(step, rng), {}, rank, create=False)
            torch.save({"what": what, "step": step, "extras": sorted(extras or {}),
                        "experts": [list(m.local_expert_ids) for m in model.moe_layers],
                        "state": {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}},
                       os.path.join(out, f"r{rank}.pt"))
            return step, what

        hooks.restore = dump
    code = _train_rank(rank, world_size, cfg, port)
    if out and rank == 0:  # the job summary rank 0 printed
        from hetcomm.train.loop import last_summary

        with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(last_summary()["text"])
    return code


def _run(cfg, world_size: int, root: str, job: str, keep: bool = False, out: str = "") -> None:
    if out:
        os.makedirs(out, exist_ok=True)
    from hetcomm.ops.job_identity import process_mark

    launch = {"HETCOMM_LAUNCH_NONCE": f"test-{job}", "HETCOMM_LAUNCH_OWNER": process_mark(os.getpid())}
    codes = run_ranks(_rank, world_size, cluster=cfg.cluster, args=(cfg, _free_port(), root, job, keep, out, launch),
                      timeout=150)
    assert codes[0] in (0, 1), codes  # 1: the tiny job's loss verdict, not a failure


def _carried_speeds(root: str, old_log, models) -> None:
    """Every kept snapshot's header names each rank's device model and the agreed measured speed
    per model (the median over its ranks of the metrics' vector at that step)."""
    import statistics

    from hetcomm.ops.snapshot_format import read_head

    vector = {s.step: s.speed_rows_per_s for s in old_log.all_steps}
    files = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".snap")]
    assert files
    for path in files:
        meta = read_head(path)["meta"]
        place = meta.get("placement")
        assert place is not None, f"{path}: the header carries no placement record"
        by_model = {}
        for r, v in enumerate(vector[meta["step"]]):
            by_model.setdefault(models[r], []).append(v)
        want = {m: statistics.median(v) for m, v in by_model.items()}
        assert place["models"] == models and place["weights"] is None and place["speeds_by_model"] == want, (
            path, place, want)


def _set_speeds(root: str, speeds) -> None:
    """Rewrite every snapshot's header with ``speeds`` (rows/s per device model): the measured
    values of these CPU ranks are noise around equal, whose placement may match the datasheet's."""
    from hetcomm.ops.snapshot_format import pack, read_bytes, unpack

    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".snap"):
                head = unpack(read_bytes(os.path.join(d, n)))
                tensors = head.pop("tensors")
                head["meta"]["placement"]["speeds_by_model"] = dict(speeds)
                with open(os.path.join(d, n), "wb") as f:
                    f.write(pack(tensors, head))


def _reshard_vs_dcp(tmp_path, old_cluster: str, new_cluster: str, old_world: int, new_world: int, lost_node: str,
                    balance, memory_only_speeds=None):
    """Old job, then the new job from memory and from DCP (and, with ``memory_only_speeds``,
    from memory without a checkpoint directory, the headers' speeds set to those); returns the
    dumps and metrics of each."""
    import torch

    from hetcomm.ops.checkpoint_files import step_dir_name
    from hetcomm.ops.safe_fs import write_private
    from hetcomm.train.loop import load_train_config

    root, job = str(tmp_path / "shm"), "reshard"
    ck, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    old = load_train_config(TINY, steps=OLD_STEPS, cluster=old_cluster, metrics=m, checkpoint_dir=ck,
                            checkpoint_every=EVERY, snapshot_every=1, balance=balance)
    _run(old, old_world, root, job, keep=True)
    if lost_node:
        shutil.rmtree(os.path.join(root, lost_node))  # the node and its memory are gone for good
    runs = {}
    if memory_only_speeds is not None:
        from hetcomm.topo.cluster import load_cluster

        models = [load_cluster(old_cluster).rank(r).model for r in range(old_world)]
        _carried_speeds(root, read_metrics(m), models)
        only = str(tmp_path / "shm-only")
        shutil.copytree(root, only)
        _set_speeds(only, memory_only_speeds)
        cfg = load_train_config(TINY, steps=NEW_STEPS, cluster=new_cluster, metrics=str(tmp_path / "m-only.jsonl"),
                                snapshot_every=1, balance=balance)
        out = str(tmp_path / "dump-only")
        _run(cfg, new_world, only, job, out=out)
        runs["memory only"] = ([torch.load(os.path.join(out, f"r{r}.pt"), weights_only=False)
                                for r in range(new_world)], read_metrics(str(tmp_path / "m-only.jsonl")))
        with open(os.path.join(out, "summary.txt"), encoding="utf-8") as f:
            runs["memory only summary"] = f.read()
    for how in ("memory", "disk"):
        ck2, m2 = str(tmp_path / f"ck-{how}"), str(tmp_path / f"m-{how}.jsonl")
        shutil.copytree(ck, ck2)
        shutil.copy(m, m2)
        if how == "memory":  # an older disk checkpoint: memory must win (and both place experts alike)
            write_private(os.path.join(ck2, "latest"), step_dir_name(OLD_STEPS - EVERY) + "\n")
        cfg = load_train_config(TINY, steps=NEW_STEPS, cluster=new_cluster, metrics=m2, checkpoint_dir=ck2,
                                checkpoint_every=EVERY, resume=True, snapshot_every=1 if how == "memory" else 0,
                                balance=balance)
        out = str(tmp_path / f"dump-{how}")
        _run(cfg, new_world, root, job, out=out)
        dumps = [torch.load(os.path.join(out, f"r{r}.pt"), weights_only=False) for r in range(new_world)]
        runs[how] = (dumps, read_metrics(m2))
    leftover = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    assert not leftover, f"the new job's normal end left snapshot files: {leftover}"
    return runs


def _assert_same_as_dcp(runs, new_world: int) -> None:
    import torch

    (mem, mem_log), (disk, disk_log) = runs["memory"], runs["disk"]
    assert all(d["step"] == OLD_STEPS for d in mem + disk), [(d["step"], d["what"]) for d in mem + disk]
    assert disk[0]["what"].startswith("from ") and "step-" in disk[0]["what"], disk[0]["what"]
    for r in range(new_world):
        assert mem[r]["experts"] == disk[r]["experts"], (r, mem[r]["experts"], disk[r]["experts"])
        a, b = mem[r]["state"], disk[r]["state"]
        assert sorted(a) == sorted(b), (r, sorted(set(a) ^ set(b))[:5])
        bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not bad, f"rank {r}: memory reshard differs from DCP's in {len(bad)} key(s): {bad[:5]}"
    for layer in range(len(mem[0]["experts"])):  # every expert owned by exactly one new rank
        owned = sorted(e for d in mem for e in d["experts"][layer])
        assert owned == list(range(EXPERTS)), (layer, owned)
    want = {s.step: s.loss for s in disk_log.steps if s.step > OLD_STEPS}
    got = {s.step: s.loss for s in mem_log.steps if s.step > OLD_STEPS}
    assert sorted(got) == list(range(OLD_STEPS + 1, NEW_STEPS + 1)) and got == want, (got, want)
    resumes = [e for e in mem_log.events if e.event == "resume"]
    assert [e.step for e in resumes][-1:] == [OLD_STEPS] and resumes[-1].detail.startswith("from memory"), resumes
    change = [e for e in mem_log.events if e.event == "membership"]
    assert change and "every expert owned by exactly one rank" in change[-1].detail, change


def test_shrink_four_to_three_restores_from_memory_as_dcp_reshards(tmp_path):
    from hetcomm.ops.job_cluster import job_cluster_yaml

    three = tmp_path / "three.yaml"
    three.write_text(job_cluster_yaml(MIXED_MINI, ["a100-0", "ascend-0"]))
    # balance="auto" (the default): the cold moves' and placements' state travel on both paths.
    speeds = {"A100-SXM4-80GB": 1.0, "H800": 5.0, "910B": 3.0}  # rows/s; the H800 is gone
    runs = _reshard_vs_dcp(tmp_path, MIXED_MINI, str(three), 4, 3, lost_node="h800-0", balance="auto",
                           memory_only_speeds=speeds)
    _assert_same_as_dcp(runs, 3)
    assert runs["memory"][0][0]["extras"] == ["cold_moves", "placement"], runs["memory"][0][0]["extras"]
    what = runs["memory"][0][0]["what"]
    # Old rank 2 lived on the lost node: its state came from its buddy's copy (the 910B node).
    assert "resharded from 4 ranks" in what and "old ranks 2 from peer copies" in what, what
    assert "lost 0 step(s)" in what, what
    # Memory only (no checkpoint directory): the experts are placed by the snapshots' speeds.
    from hetcomm.moe.layer_config import MoEConfig
    from hetcomm.moe.placement import place_experts
    from hetcomm.topo.cluster import load_cluster

    c3 = load_cluster(str(three))
    measured = place_experts(EXPERTS, 3, rank_weights=[speeds[c3.rank(r).model] for r in range(3)]).owner
    # The layer's own map without measured speeds (MoELayer, rank_weights="strong"): the strong
    # ranks (the A100s) weigh strong_expert_weight, the others 1.
    strong = set(c3.strong_ranks)
    datasheet = place_experts(EXPERTS, 3, rank_weights=[MoEConfig.strong_expert_weight if r in strong else 1.0
                                                        for r in range(3)]).owner
    assert measured != datasheet, (measured, datasheet)  # the speeds above are chosen to differ
    only, only_log = runs["memory only"]
    # ... and the change is recorded from the snapshots' headers (no membership.json to say who
    # trained before): the metrics event and the summary row, with what it cannot know said so.
    change = [e for e in only_log.events if e.event == "membership"]
    assert len(change) == 1 and change[0].step == OLD_STEPS, change
    line = change[0].detail
    assert line.startswith(f"4 -> 3 ranks after step {OLD_STEPS}: node(s) h800-0 left"), line
    assert "0 step(s) redone" in line and "to the restored state unknown" in line, line
    assert "every expert owned by exactly one rank" in line, line
    assert "placement from measured speeds of the in-memory snapshots" in line, line
    row = next((ln for ln in runs["memory only summary"].splitlines() if "membership change" in ln), None)
    assert row is not None and line in row, runs["memory only summary"]
    from hetcomm.ops.ops_records import sibling_path

    with open(sibling_path(str(tmp_path / "m-only.jsonl")), encoding="utf-8") as f:
        rec = [json.loads(ln) for ln in f if '"membership"' in ln]
    assert [(r["previous"], r["down_s"], r["line"]) for r in rec] == [("snapshots", None, line)], rec
    got = [[next(r for r in range(3) if e in only[r]["experts"][layer]) for e in range(EXPERTS)]
           for layer in range(len(only[0]["experts"]))]
    assert got == [list(measured)] * len(got), (got, measured, datasheet)
    assert only[0]["step"] == OLD_STEPS and "resharded from 4 ranks" in only[0]["what"], only[0]["what"]


def test_grow_three_to_four_gives_the_returning_rank_its_experts_from_memory(tmp_path):
    from hetcomm.ops.job_cluster import job_cluster_yaml

    three = tmp_path / "three.yaml"
    three.write_text(job_cluster_yaml(MIXED_MINI, ["a100-0", "ascend-0"]))
    runs = _reshard_vs_dcp(tmp_path, str(three), MIXED_MINI, 3, 4, lost_node="", balance=False)
    _assert_same_as_dcp(runs, 4)
    mem = runs["memory"][0]
    what = mem[0]["what"]
    assert "resharded from 3 ranks" in what and "peer copies" not in what, what
    assert any(mem[2]["experts"]), "the returning h800 rank owns no expert: nothing came over the wire"


# -- the restore itself, below the training loop ---------------------------------------------------

D, E = 16, 8
NODES4 = ["a100", "a100", "h800", "ascend"]


class _Counter:
    """A per-rank extra (as PowerSGD's error feedback): restored whole on the
    same membership, started afresh after a reshard."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self):
        import torch

        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, sd) -> None:
        self.value = int(sd["value"])


def _holder(weights, dim: int = D):
    import torch

    from hetcomm.moe import MoELayer
    from hetcomm.moe.placement import place_experts

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = MoELayer(dim, E, k=2, dropless=True, wire_dtype="fp32", seed=7,
                                placement=place_experts(E, len(weights), rank_weights=weights))

    return Holder()


def _inputs():
    import torch

    return torch.randn(64, D, generator=torch.Generator().manual_seed(42))


def _probe(model, opt):
    """(the layer's output on fixed inputs, {expert id: its first weight's Adam moment})."""
    import torch

    with torch.no_grad():
        out = model.moe(_inputs())
    moments = {}
    for i, e in enumerate(model.moe.local_expert_ids):
        p = next(model.moe.experts.experts[i].parameters())
        moments[int(e)] = opt.state[p]["exp_avg"].clone()
    return out, moments


def _launch_env() -> dict:
    """``hetcomm launch``'s launch identity for the ranks: the runs of one test are restarts of
    one launch (this test process owns it), so a later run restores what an earlier one left."""
    from hetcomm.ops.job_identity import process_mark

    return {"HETCOMM_LAUNCH_NONCE": "test-unit", "HETCOMM_LAUNCH_OWNER": process_mark(os.getpid())}


def _snapshots_on(rank: int, world_size: int, root: str, nodes, weights, train: bool, dim: int = D):
    """Train 2 steps and snapshot them (``train``), or restore into a fresh model; either way
    return the layer's output and the experts' moments, and the extra's value."""
    import torch

    from hetcomm.ops.snapshot import Snapshotter

    os.environ["HETCOMM_SNAPSHOT_ROOT"] = os.path.join(root, nodes[rank])
    os.environ["HETCOMM_JOB_ID"] = "unit"
    model = _holder(weights, dim)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    extra = _Counter(100 + rank)
    snap = Snapshotter(rank, world_size, nodes, every=1, peer=True, timeout_s=30)
    got = None
    if train:
        for step in (1, 2):
            loss = model.moe(torch.randn(32, D, generator=gen)).square().mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():  # the gate is data parallel: equal on every rank
                if p.grad is not None and not getattr(p, "hetcomm_expert", False):
                    torch.distributed.all_reduce(p.grad)
            opt.step()
            extra.value += 1
            snap.take(step, model, opt, gen, {"extra": extra})
    else:
        got = snap.restore(model, opt, gen, {"extra": extra})
    snap.close(remove=False)
    out, moments = _probe(model, opt)
    return out, moments, extra.value, got, list(model.moe.local_expert_ids)


def test_restore_reshards_onto_other_nodes_and_starts_per_rank_extras_afresh(tmp_path):
    import torch

    root = str(tmp_path)
    old = run_ranks(_snapshots_on, 4, args=(root, NODES4, [1.0] * 4, True), timeout=90, env=_launch_env())
    ref, ref_moments = old[0][0], {e: m for _, ms, _, _, _ in old for e, m in ms.items()}
    assert sorted(ref_moments) == list(range(E)) and [v for _, _, v, _, _ in old] == [102, 103, 104, 105]
    shutil.rmtree(os.path.join(root, "h800"))  # lost for good
    cases = {
        "4 -> 3": (["a100", "a100", "ascend"], [2.0, 2.0, 1.0]),
        # as many ranks, but a new node for the lost one: the map changed, so a reshard too
        "4 -> 4, h800 replaced": (["a100", "a100", "h800b", "ascend"], [1.0, 1.0, 2.0, 1.0]),
    }
    for name, (nodes, weights) in cases.items():
        new = run_ranks(_snapshots_on, len(nodes), args=(root, nodes, weights, False), timeout=90, env=_launch_env())
        owned = sorted(e for *_, ids in new for e in ids)
        assert owned == list(range(E)), (name, owned)
        for r, (out, moments, value, got, _) in enumerate(new):
            assert (got.step, got.resharded_from, got.from_peer) == (2, 4, (2,)), (name, r, got)
            assert torch.equal(out, ref), (name, r, (out - ref).abs().max().item())
            assert all(torch.equal(m, ref_moments[e]) for e, m in moments.items()), (name, r)
            assert value == 100 + r, (name, r, value)  # per rank of the old world: not mapped, fresh
    # Another model (width 8): every rank refuses alike, naming the key, before any tensor moves.
    from tests.backends.ranks import run_ranks_outcomes

    outs = run_ranks_outcomes(_snapshots_on, 3, args=(root, ["a100", "a100", "ascend"], [1.0] * 3, False, 8),
                              timeout=90, env=_launch_env())
    errors = {(o.error_type, o.error) for o in outs}
    assert not any(o.ok for o in outs) and len(errors) == 1, errors
    kind, message = errors.pop()
    assert kind == "CheckpointError" and "of shape (64,)" in message, (kind, message)
    # The same membership restores the extra whole (no reshard).
    same = run_ranks(_snapshots_on, 4, args=(root + "-same", NODES4, [1.0] * 4, True), timeout=90, env=_launch_env())
    back = run_ranks(_snapshots_on, 4, args=(root + "-same", NODES4, [1.0] * 4, False), timeout=90, env=_launch_env())
    assert [v for *_, v, _, _ in back] == [v for *_, v, _, _ in same] and back[0][3].resharded_from is None


# -- the plan, in one process -------------------------------------------------------------------


def test_newest_complete_step_over_world_sizes():
    from hetcomm.ops.snapshot_reshard import newest_complete

    held = {(4, r, s): {0: "r"} for r in range(4) for s in (11, 12)}
    del held[(4, 2, 12)]  # step 12 of old rank 2 is held nowhere: 11 is the newest complete step
    assert newest_complete(held, 3) == (4, 11)
    assert newest_complete(held, 3, below=11) is None  # nothing before 11: resume from disk
    held.update({(3, r, 11): {r: "r"} for r in range(3)})
    assert newest_complete(held, 3) == (3, 11)  # a tie: this job's own world size
    assert newest_complete({}, 3) is None


def test_holders_prefer_the_same_rank_then_an_own_file():
    from hetcomm.ops.snapshot_reshard import choose_holders

    # 4 -> 3: old ranks 0, 1 on node a (new 0, 1), old 2's node lost (its copy on node c, new
    # rank 2), old 3's own file on node c.
    held = {(4, 0, 5): {0: "r", 1: "r"}, (4, 1, 5): {0: "r", 1: "r", 2: "p"}, (4, 2, 5): {2: "p"},
            (4, 3, 5): {2: "r", 0: "p", 1: "p"}}
    assert choose_holders(held, 4, 5) == [0, 1, 2, 2]
    with pytest.raises(KeyError):
        choose_holders({(4, 0, 5): {0: "r"}}, 4, 5)


def test_requests_take_experts_by_owner_and_dense_state_from_a_local_snapshot():
    from hetcomm.ops.snapshot_reshard import plan_requests

    dense = {"model/w", "optim/model/w/exp_avg", "train/step"}
    keys_of = {0: dense | {"expert/l/0/w", "optim/expert/l/0/w/step", "train/rng/0"},
               1: dense | {"expert/l/1/w", "train/rng/1"}}
    want = sorted(dense | {"expert/l/1/w", "optim/expert/l/1/w/step", "train/rng/2"})
    req, missing = plan_requests(want, keys_of, rank=2, local=[1])
    assert req == {1: ["expert/l/1/w", "model/w", "optim/model/w/exp_avg", "train/step"]}
    # an optimizer state the old owner never had, and a stream the old job had no rank for
    assert missing == ["optim/expert/l/1/w/step", "train/rng/2"]


def test_snapshot_placement_reads_the_headers_speeds_and_keeps_old_snapshots_readable():
    from hetcomm.ops.membership import snapshot_placement
    from hetcomm.topo.cluster import load_cluster

    c = load_cluster(MIXED_MINI)
    models = [c.rank(r).model for r in range(4)]
    nodes = [c.rank(r).node.name for r in range(4)]
    speeds = {"A100-SXM4-80GB": 1.0, "H800": 4.0, "910B": 2.0}
    three = {"world_size": 3, "nodes": ["a100-0", "a100-0", "ascend-0"],
             "placement": {"models": [models[0], models[1], models[3]], "weights": None, "speeds_by_model": speeds}}
    assert snapshot_placement(three, c, 4)[0] == [1.0, 1.0, 4.0, 2.0]  # grown: every model measured
    three["placement"]["speeds_by_model"] = {"A100-SXM4-80GB": 1.0, "910B": 2.0}
    w, how = snapshot_placement(three, c, 4)
    assert w is None and "no measured speed of H800" in how, how  # a model the snapshots never had
    same = {"world_size": 4, "nodes": nodes, "placement": {"models": models, "weights": [3.0, 3.0, 1.0, 1.0],
                                                          "speeds_by_model": speeds}}
    assert snapshot_placement(same, c, 4)[0] == [3.0, 3.0, 1.0, 1.0]  # same membership: its own placement
    w, how = snapshot_placement({"world_size": 3, "nodes": three["nodes"], "placement": None}, c, 4)
    assert w is None and "older hetcomm" in how, how  # a header without placement: datasheet, still restores
    assert snapshot_placement(None, c, 4) == (None, "datasheet")
