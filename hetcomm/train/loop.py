"""The ``hetcomm train`` job: spawn (or join) ranks, train the demo MoE LM, report.

Parallelism: the dense parameters (embedding, attention, norms, gates) are data parallel — their
gradients are averaged over the group with one flat all-reduce per step; the experts are expert
parallel — each lives on one rank (plus replicas of hot experts on strong ranks, kept identical by
the layer), and receives gradient from every rank's tokens through the all-to-all's backward.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from hetcomm._yaml import load_yaml, reject_unknown_keys
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import CLUSTER_ENV, load_cluster
from hetcomm.wire_dtypes import LAYER_SPELLINGS, parse_wire_dtype
from hetcomm.train import elastic
from hetcomm.train.data import MarkovTask
from hetcomm.train.lm import LMConfig, MoETransformerLM
from hetcomm.train.summary import Progress, compression_per_rank, group_backends, summarise

#: ``TrainConfig.cluster`` value (``hetcomm train --cluster detect``): no cluster file, detect it.
DETECT = "detect"
#: Ranks spawned on one machine for a detected cluster when ``--nprocs`` is not given.
DETECT_DEFAULT_RANKS = 4

__all__ = ["TrainConfig", "load_train_config", "launch", "train_worker"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything one ``hetcomm train`` run needs (``configs/train/demo.yaml`` holds the defaults).

    Attributes:
        cluster: cluster YAML deciding rank placement, strong ranks and wire dtypes, or
            ``detect``: no file, the backend probes every host when the group is created
            (``hetcomm.topo.discover``) and the job runs on the cluster it assembles.
        steps: optimizer steps.
        experts: global experts per MoE layer.
        layers: transformer blocks (each with one MoE layer).
        model_dim / hidden_dim: width of the model / of each expert's FFN.
        batch_size / seq_len: per-rank sequences per step and their length.
        lr: AdamW learning rate.
        replicate: hot-expert replication on strong ranks.
        calibrate: load-aware gate calibration.
        wire_dtype: ``auto`` (the cluster's per-link policy) or ``fp32``/``fp16``/``bf16``.
        backend: process-group backend (``hetcomm``; ``gloo`` for comparison).
        seed: seed of the model and of the data streams (rank r uses ``seed + r``).
        log_every: steps between progress lines when stderr is not a terminal.
        timeout_s: collective timeout; a rank that stops answering fails the run after this long.
        metrics: JSON-lines file for one record per step (:mod:`hetcomm.ops.metrics`), or None.
        checkpoint_dir: directory of sharded checkpoints (:mod:`hetcomm.ops.checkpoint`), or None.
        checkpoint_every: steps between checkpoints (0: none).
        keep_checkpoints: committed checkpoints kept in ``checkpoint_dir``; older ones are deleted
            once a newer one is complete (0: keep all).
        resume: continue from ``checkpoint_dir``'s latest checkpoint when there is one.
        balance: heterogeneity balancing. ``auto`` (default): once per layer the experts
            re-placed to even the ranks' measured busy time when their speeds differ beyond
            noise (:mod:`hetcomm.moe.cold`, :func:`hetcomm.moe.speed.slow_ranks`); True
            (``--balance``): the expert balancer's migrations by measured speed
            (:mod:`hetcomm.train.balance`); False: none of them, and no decision reads a speed
            (equal contiguous placement, nothing measured: :mod:`hetcomm.train.speed_modes`).
        speed: where rank speeds come from: ``measured`` (default; the layers' one rank-speed
            source, :mod:`hetcomm.moe.speed`), ``datasheet`` (``hetcomm.topo.compute`` only:
            every decision then depends on the data alone, so a run repeats bit for bit,
            e.g. a resumed one its uninterrupted twin) or ``oracle`` (the emulation's compute factors
            from the cluster file, ``emulation.compute_scale``, given and taken as true: nothing measured,
            used wherever measured speeds would be: :mod:`hetcomm.train.speed_modes`).
            Which levers are on follows from this and ``balance`` (:mod:`hetcomm.moe.policy`).
        balance_every / balance_cooldown: steps between plan evaluations / before an expert
            that moved may move again.
        powersgd_rank: PowerSGD rank for the dense gradients on cross-node pairs (0: off).
        powersgd_experts: PowerSGD rank for the hot-expert replicas' gradient sums on cross-node
            pairs (``MoEConfig.replicate_powersgd``; needs ``replicate``; 0: exact).
        warmup_from: a previous run's metrics file: seeds calibrators and hot experts before the
            first step (``hetcomm launch`` phase 2), or None.
        page_budget: expert paging (``MoEConfig.page_budget``): the fraction of each rank's
            experts kept on the device, the rest paged in from a host pool as routed (0: off).
        token_split: per-step, time-proportional split of hot experts' rows among their copies
            by measured speed (:mod:`hetcomm.moe.policy`): ``auto`` (default: on once the agreed
            speeds differ), True or False.
        chunks: pipelined dispatch chunks (``MoEConfig.num_chunks``), or ``auto``.
        snapshot_every: steps between in-memory snapshots (:mod:`hetcomm.ops.snapshot`; 0: none),
            or ``auto``: every step under torchrun (``hetcomm launch``), none otherwise.
        snapshot_peer: also keep each snapshot on a rank of another node.
        checkpoint_async: write the periodic disk checkpoints in the background (DCP ``async_save``).
        probe_every: steps per window of the in-training health probe (:mod:`hetcomm.ops.probe`:
            each rank's expert compute and links judged against its device/link class, written
            to the health records beside ``metrics`` / in the launch directory; 0: off).
        shrink_in_place: when a rank dies, the survivors shrink the group (``dist.shrink_group``,
            torch >= 2.14) and rebuild the job on the smaller world in the same processes, from
            the in-memory snapshots (:mod:`hetcomm.train.inplace`); needs ``snapshot_every`` > 0.
        grow_back: with ``shrink_in_place``, the launcher starts a replacement in a killed rank's
            slot and the survivors take it back in through ``dist._reconfigure`` at an agreed step
            (:mod:`hetcomm.train.growback`).
    """

    cluster: str = "configs/clusters/mixed-mini.yaml"
    steps: int = 200
    experts: int = 8
    layers: int = 2
    model_dim: int = 64
    hidden_dim: int = 128
    batch_size: int = 16
    seq_len: int = 32
    lr: float = 3e-3
    replicate: bool = True
    calibrate: bool = True
    wire_dtype: str = "auto"
    backend: str = "hetcomm"
    seed: int = 0
    log_every: int = 25
    timeout_s: float = 120.0
    metrics: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    balance: Union[bool, str] = "auto"
    speed: str = "measured"
    balance_every: int = 50
    balance_cooldown: int = 1000
    powersgd_rank: int = 0
    powersgd_experts: int = 0
    warmup_from: Optional[str] = None
    page_budget: float = 0.0
    token_split: Union[bool, str] = "auto"
    chunks: Union[int, str] = "auto"
    snapshot_every: Union[int, str] = "auto"
    snapshot_peer: bool = True
    checkpoint_async: bool = False
    probe_every: int = 50
    shrink_in_place: bool = False
    grow_back: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"must be a whole number >= 0, got {self.checkpoint_every!r}", key="train.checkpoint_every")
        keep = self.keep_checkpoints
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"must be a whole number >= 0 (0: keep all), got {self.keep_checkpoints!r}",
                              key="train.keep_checkpoints")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError(
                "checkpoint_every / resume need a checkpoint directory; pass --checkpoint-dir DIR",
                key="train.checkpoint_dir",
            )
        for name in ("steps", "experts", "layers", "model_dim", "hidden_dim", "batch_size", "seq_len", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"must be a positive whole number, got {value!r}", key=f"train.{name}")
        if not self.lr > 0:
            raise ConfigError(f"must be > 0, got {self.lr!r}", key="train.lr")
        parse_wire_dtype(self.wire_dtype, allowed=LAYER_SPELLINGS, key="train.wire_dtype")
        for name in ("balance_every", "balance_cooldown", "powersgd_rank", "powersgd_experts", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "balance_every" else 0):
                raise ConfigError(f"must be a whole number >= {1 if name == 'balance_every' else 0}, got {value!r}",
                                  key=f"train.{name}")
        if self.powersgd_experts and not self.replicate:
            raise ConfigError("compresses the replicas' gradient sums, and replication is off; set replicate: true "
                              "or powersgd_experts: 0", key="train.powersgd_experts")
        if self.experts < 2:
            raise ConfigError("an MoE layer needs at least 2 experts", key="train.experts")
        pb = self.page_budget
        if isinstance(pb, bool) or not isinstance(pb, (int, float)) or not 0.0 <= pb <= 1.0:
            raise ConfigError(f"must be a fraction within [0, 1] (0 = paging off), got {pb!r}", key="train.page_budget")
        if self.balance not in (True, False, "auto"):
            raise ConfigError(f"must be true, false or 'auto', got {self.balance!r}", key="train.balance")
        if self.speed not in ("measured", "datasheet", "oracle"):
            raise ConfigError(f"must be 'measured', 'datasheet' or 'oracle', got {self.speed!r}", key="train.speed")
        if self.token_split not in (True, False, "auto"):
            raise ConfigError(f"must be true, false or 'auto', got {self.token_split!r}", key="train.token_split")
        se = self.snapshot_every
        if se != "auto" and (isinstance(se, bool) or not isinstance(se, int) or se < 0):
            raise ConfigError(f"must be a whole number >= 0 or 'auto', got {se!r}", key="train.snapshot_every")
        if not isinstance(self.shrink_in_place, bool):
            raise ConfigError(f"must be true or false, got {self.shrink_in_place!r}", key="train.shrink_in_place")
        if not isinstance(self.grow_back, bool) or (self.grow_back and not self.shrink_in_place):
            raise ConfigError(f"grows a job back after an in-place shrink: needs shrink_in_place: true (--shrink-in-place), "
                              f"got grow_back {self.grow_back!r}", key="train.grow_back")
        if self.shrink_in_place and se == 0:
            raise ConfigError("an in-place shrink restores the survivors from the in-memory snapshots; "
                              "set snapshot_every to N > 0 or 'auto'", key="train.snapshot_every")
        if self.chunks != "auto" and (isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1):
            raise ConfigError(f"must be a positive whole number or 'auto', got {self.chunks!r}", key="train.chunks")


def load_train_config(path: str, **overrides: Any) -> TrainConfig:
    """Read a train config YAML (keys = :class:`TrainConfig` fields), then apply ``overrides``.

    Raises:
        ConfigError: unknown key (with did-you-mean), bad value, naming file and line.
    """
    src = load_yaml(path)
    if not isinstance(src.data, dict):
        raise src.error("", "expected a mapping of train settings")
    names = [f.name for f in fields(TrainConfig)]
    reject_unknown_keys(src, src.data, "", names)
    try:
        cfg = TrainConfig(**src.data)
    except ConfigError as e:
        key = (e.key or "").removeprefix("train.")
        raise src.error(key, e.detail) from None
    except TypeError as e:
        raise src.error("", f"bad value: {e}") from None
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if not os.path.exists(cfg.cluster) and not os.path.isabs(cfg.cluster):
        # A relative cluster path in a config file is relative to the repository root.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path))))
        candidate = os.path.join(root, cfg.cluster)
        if os.path.exists(candidate):
            cfg = replace(cfg, cluster=candidate)
    return cfg


# -- launching ------------------------------------------------------------------------------


def launch(cfg: TrainConfig, nprocs: Optional[int] = None) -> int:
    """Run the job: under torchrun (``RANK``/``WORLD_SIZE`` set) join it, else start local ranks.

    Local ranks are started by :func:`hetcomm.launcher.launch` (fresh interpreters; the launcher
    hosts the store, so ``env://`` needs no free port): the first rank to fail stops the others,
    and the run is stopped after ``timeout_s + 10 s per step``, naming the ranks that were late.

    Returns:
        0 when training finished with the loss well below the unigram baseline, 1 otherwise.
    """
    from hetcomm.launcher import launch as launch_ranks

    detect = cfg.cluster == DETECT
    # The parent reads the file only to size the job; every rank parses it once itself and hands
    # the object to the backend through pg_options (train_worker), never through the environment.
    cluster = None if detect else load_cluster(cfg.cluster)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return train_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)
    world_size = nprocs or (cluster.num_ranks if cluster is not None else DETECT_DEFAULT_RANKS)
    if cluster is not None and world_size != cluster.num_ranks:
        raise ConfigError(
            f"cluster '{cluster.name}' has {cluster.num_ranks} ranks but {world_size} processes were asked "
            f"for; use --nprocs {cluster.num_ranks} or another --cluster",
            path=cluster.path,
        )
    from hetcomm.ops import hooks

    done = hooks.disk_step(cfg)
    if done >= cfg.steps > 0:
        # Nothing left to train: say so here, before starting any rank. Ranks started by this call
        # get a fresh snapshot job, so no in-memory state can be newer than the disk checkpoint.
        from hetcomm.ops.checkpoint_files import verify_checkpoint

        verify_checkpoint(hooks.latest_checkpoint(cfg.checkpoint_dir))  # a damaged one is still named
        return hooks.nothing_to_train(cfg, 0, done)
    env: Dict[str, Optional[str]] = {CLUSTER_ENV: None}  # the ranks get the cluster as an object (pg_options)
    snapshot_job = None
    from hetcomm.train import inplace

    in_place = inplace.enabled(cfg)  # a lost rank's survivors go on: snapshots on, nobody stopped
    if (isinstance(cfg.snapshot_every, int) and cfg.snapshot_every > 0) or in_place:
        import uuid

        from hetcomm import settings

        snapshot_job = f"train-{uuid.uuid4().hex[:12]}"
        env[settings.JOB_ID.name] = snapshot_job  # names the ranks' snapshot segments; removed below
        if in_place:  # one launch whatever rank is lost (else rank 0's process names it)
            from hetcomm.ops.job_identity import new_launch_env

            env.update(new_launch_env())
    from hetcomm.train.local_ranks import exit_code, launch_options

    try:
        outcome = launch_ranks(_rank_main, world_size, launch_options(cfg, in_place), env=env)
    finally:
        if snapshot_job is not None:
            from hetcomm.ops.snapshot import remove_job

            remove_job(snapshot_job)  # whatever the outcome: nothing left in shared memory
    return exit_code(outcome, in_place)


def _rank_main(cfg: TrainConfig) -> int:
    """One locally launched rank (the launcher's target); returns the job's exit code."""
    return train_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg)


# -- one rank -------------------------------------------------------------------------------


def _split_parameters(model: torch.nn.Module):
    """(dense, expert) trainable parameters: experts and replicas are not data parallel."""
    dense, expert = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue  # e.g. the frozen calibration weights
        (expert if getattr(p, "hetcomm_expert", False) else dense).append(p)
    return dense, expert


def _allreduce_dense_grads(params: List[torch.nn.Parameter], world_size: int) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _loss_slots(loss: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's loss in its own slot of ``[world_size]`` float32 zeros (on the loss's device):
    summed over the group (in a replica refresh's all-reduce or one of its own), every slot
    arrives exact whatever order the reduction adds in, so the loss can ride in a collective of
    any length."""
    slots = torch.zeros(world_size, dtype=torch.float32, device=loss.device)
    slots[rank] = loss.detach().float()
    return slots


def _loss_sum(slots: torch.Tensor) -> float:
    """The ranks' losses added exactly (``math.fsum``, correctly rounded): the same number on
    every rank, whichever collective carried the slots and whatever order the backend adds in."""
    return math.fsum(slots.tolist())


def train_worker(rank: int, world_size: int, cfg: TrainConfig) -> int:
    """Train on this rank; rank 0 prints progress and the summary. Returns the job's exit code."""
    import hetcomm  # noqa: F401  (registers the backend)
    from hetcomm.moe import MoELayer
    from hetcomm.ops import rank_marks

    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only contend
    # Parsed once on this rank; the backend gets the object as an explicit option, which beats a
    # stray $HETCOMM_CLUSTER (cluster: detect passes an explicit None: the backend probes the hosts).
    cluster = None if cfg.cluster == DETECT else load_cluster(cfg.cluster)
    pg_options = None
    if cfg.backend == "hetcomm":
        from hetcomm.backends.options import HetcommOptions

        pg_options = HetcommOptions(cluster=cluster)
    rank_marks.startup("imports")  # startup marks: the parts of a recovery (the resume event)
    from hetcomm.train import growback

    if growback.joining():  # a killed rank's replacement: a group of one until the survivors take it in
        dist.init_process_group(cfg.backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                                pg_options=pg_options, enable_reconfigure=True)
        try:
            return growback.join(rank, world_size, cfg, lambda r, w, c: _build(r, w, cfg, MoELayer, c), _start,
                                 lambda job, step: _loop(job, step, MoELayer))
        finally:
            dist.destroy_process_group()
    dist.init_process_group(
        cfg.backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s),
        pg_options=pg_options,
    )
    rank_marks.startup("group")
    try:
        return _train(rank, world_size, cfg, MoELayer, cluster)
    finally:
        dist.destroy_process_group()


def _job_cluster(cfg: TrainConfig, cluster=None):
    """The cluster file's cluster (``cluster``, parsed once by :func:`train_worker`), or
    (``cluster: detect``) the one the backend detected."""
    if cfg.cluster != DETECT:
        return cluster if cluster is not None else load_cluster(cfg.cluster)
    import hetcomm

    cluster = hetcomm.communicator().cluster
    if cluster is None:
        raise ConfigError(
            "cluster detection is off (HETCOMM_DETECT=0) or failed; give a cluster file with --cluster",
            key="train.cluster",
        )
    return cluster


@dataclass
class _Rank:
    """One rank's training job: what :func:`_build` makes and the per-step parts read.

    Attributes:
        dense: the data-parallel parameters (the expert-parallel ones are read from the model
            each step: a placement by speed may add or drop expert modules).
        extras: the ``Stateful`` objects checkpoints and snapshots carry beside the model.
        policy: which heterogeneity levers are on and why (:mod:`hetcomm.moe.policy`).
        measured, balancer, psgd: the measured loop (replica refresh, paging step end, cold
            move, the balancer's plans), the balancer and PowerSGD (:func:`_add_levers`).
        start_step: the step this process's training started after; step_done_at: when its
            last step finished (``time.time()``; None: none yet); slots: the cluster file's
            rank of each rank after an in-place shrink (empty: rank r is slot r); shrinks: how
            many (:mod:`hetcomm.train.inplace`).
    """

    cfg: TrainConfig
    rank: int
    world_size: int
    cluster: Any
    task: MarkovTask
    model: MoETransformerLM
    opt: torch.optim.Optimizer
    gen: torch.Generator
    dense: List[torch.nn.Parameter]
    extras: Dict[str, Any]
    policy: Any = None
    measured: Any = None
    balancer: Any = None
    psgd: Any = None
    snap: Any = None
    snap_record: Any = None
    placement_from: str = "datasheet"
    expert_clock: Any = None
    losses: List[float] = field(default_factory=list)
    mc: Any = None
    progress: Any = None
    probe: Any = None
    change: Any = None
    start_step: int = 0
    step_done_at: Optional[float] = None
    slots: List[int] = field(default_factory=list)
    shrinks: int = 0

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step on one rank."""
        return self.cfg.batch_size * self.cfg.seq_len


def _train(rank: int, world_size: int, cfg: TrainConfig, MoELayer, cluster=None) -> int:
    from hetcomm.ops import hooks, rank_marks

    job = _build(rank, world_size, cfg, MoELayer, _job_cluster(cfg, cluster))
    rank_marks.startup("model")
    start_step, resumed_from = hooks.restore(cfg, job.model, job.opt, job.gen, job.extras or None, job.snap)
    rank_marks.startup("restore")
    if start_step >= cfg.steps:  # nothing left to train: report the recorded verdict, not a fresh one
        return hooks.nothing_to_train(cfg, rank, start_step)
    # The clocks (the summary's, the metrics', the progress line's) start when every rank is
    # ready: a rank that builds its model slower (a slower device) would otherwise put its build
    # time into the other ranks' first step, and into the run's tokens/s.
    dist.barrier()
    _start(job, start_step, resumed_from)
    from hetcomm.train import inplace

    if rank == 0 and inplace.why_not(cfg):
        print(f"hetcomm train: {inplace.why_not(cfg)}", file=sys.stderr, flush=True)
    return _loop(job, start_step + 1, MoELayer)


def _loop(job: _Rank, step: int, MoELayer) -> int:
    """Train from ``step`` to the last step (an in-place shrink or grow-back swaps ``job``), then finish."""
    from hetcomm.train import growback, inplace

    cfg = job.cfg
    in_place = inplace.enabled(cfg)
    t0 = time.perf_counter()

    def build(r: int, w: int, c) -> _Rank:
        return _build(r, w, cfg, MoELayer, c)

    while step <= cfg.steps:
        try:
            _step(job, step)
            job.step_done_at = time.time()
        except Exception as e:  # noqa: BLE001 - a lost peer's, confirmed by the heartbeat, or raised again
            if not in_place:
                raise
            job, step = inplace.shrink(job, e, build, _start)
            continue
        step += 1
        if in_place and cfg.grow_back:
            job, step = growback.maybe_grow(job, step, build, _start)
    growback.finished(job)
    return _finish(job, t0)


def _step(job: _Rank, step: int) -> None:
    """One optimizer step; its parts in order, every collective at the same point on every rank."""
    cfg, model, mc = job.cfg, job.model, job.mc
    mc.start_step()
    batch = job.task.sample(cfg.batch_size, cfg.seq_len, job.gen)
    mc.mark("data")
    loss, aux = _forward(job, batch)
    mc.mark("forward")
    job.opt.zero_grad(set_to_none=True)
    (loss + 0.01 * aux).backward()
    mc.mark("backward")
    _sync_gradients(job)
    mc.mark("grad_sync")
    job.opt.step()
    mc.mark("optimizer")
    loss_slots, carry = _refresh_and_rebalance(job, step, loss)
    mc.mark("replica_sync")
    if carry:  # no refresh over the whole group this step (none hot yet, or holders only)
        dist.all_reduce(loss_slots)
    job.losses.append(_loss_sum(loss_slots) / job.world_size)
    job.expert_clock.end_step()
    mc.mark("loss_sync")
    mc.end_step(step, job.losses[-1], job.tokens_per_step * job.world_size)
    _save(job, step)
    job.probe.after_step(step, model.moe_layers)
    job.progress.update(step, job.losses[-1], job.tokens_per_step * job.world_size, model)


def _forward(job: _Rank, batch: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The model's loss on ``batch`` (``[B, S+1]`` int64 tokens) and the MoE layers' auxiliary loss."""
    _, loss = job.model(batch[:, :-1], batch[:, 1:])
    aux = sum(m.l_aux for m in job.model.moe_layers)
    return loss, aux


def _sync_gradients(job: _Rank) -> None:
    """Expert gradients scaled to the global mean; the balancer's migrations land; the dense
    gradients averaged over the group (PowerSGD on cross-node pairs with ``--powersgd``)."""
    # The experts of now: a placement by speed or a restore may have added or dropped modules.
    expert = _split_parameters(job.model)[1] + (job.balancer.spare_parameters() if job.balancer is not None else [])
    expert = list({id(p): p for p in expert}.values())  # a balancer's spare may be in the model now
    for p in expert:  # the global loss is the mean over ranks: scale the expert-parallel grads
        if p.grad is not None:
            p.grad /= job.world_size
    if job.balancer is not None:
        job.balancer.after_backward()  # migrations started last step land; old owners computed this one
    if job.psgd is not None:
        for p in job.dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        job.psgd.all_reduce_mean([p.grad for p in job.dense])
    else:
        _allreduce_dense_grads(job.dense, job.world_size)


def _refresh_and_rebalance(job: _Rank, step: int, loss: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """After the optimizer: the measured loop (:class:`hetcomm.moe.MeasuredLoop`: replicas
    refreshed, paging's step end, the policy's verdict, the cold move, the balancer's plans),
    the first refresh over the whole group carrying the loss (one all-reduce fewer). Returns
    the loss slots and what is left of ``carry`` (empty: the loss was summed)."""
    loss_slots = _loss_slots(loss, job.rank, job.world_size)
    carry = [loss_slots]
    for ev in job.measured.after_step(step, carry=carry):
        job.mc.event(step, ev.kind, ev.detail)
    job.policy = job.measured.policy
    return loss_slots, carry


def _save(job: _Rank, step: int) -> None:
    """The step's checkpoint when due (after a membership record), and its snapshot."""
    from hetcomm.ops import hooks
    from hetcomm.ops.membership import after_checkpoint

    cfg, model = job.cfg, job.model
    if cfg.page_budget > 0 and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        for m in model.moe_layers:
            m.sync_pages()  # the checkpoint reads the experts: no write-back half done
    if hooks.maybe_checkpoint(cfg, step, model, job.opt, job.gen, job.mc, job.extras or None):
        after_checkpoint(cfg, job.rank, job.world_size, job.cluster, model)  # the membership record
    hooks.maybe_snapshot(cfg, job.snap, step, model, job.opt, job.gen, job.extras or None, job.mc)


def _build(rank: int, world_size: int, cfg: TrainConfig, MoELayer, cluster) -> _Rank:
    """The model, its optimizer, the data stream and the balancing levers of one rank (the
    snapshots' placement record read first: collective when snapshots are on)."""
    from hetcomm.moe import MoEConfig
    from hetcomm.moe.policy import PolicyInputs, cluster_kind, decide
    from hetcomm.ops import hooks
    from hetcomm.train import speed_modes
    from hetcomm.train.expert_time import ExpertCpuClock

    task = MarkovTask(vocab_size=256, seed=1234 + cfg.seed)
    lm_cfg = LMConfig(
        vocab_size=task.vocab_size,
        seq_len=cfg.seq_len,
        model_dim=cfg.model_dim,
        num_layers=cfg.layers,
        num_experts=cfg.experts,
        hidden_dim=cfg.hidden_dim,
    )

    expert_clock = ExpertCpuClock()  # the experts' share of the rank's busy time (summary row)

    def expert_factory(dim: int) -> torch.nn.Module:
        return expert_clock.instrument(torch.nn.Sequential(
            torch.nn.Linear(dim, cfg.hidden_dim), torch.nn.GELU(), torch.nn.Linear(cfg.hidden_dim, dim)
        ))

    device = torch.device("cpu")  # the demo LM runs on CPU ranks
    # -- policy: every lever decided once, from agreed inputs (hetcomm.moe.policy) --
    policy = decide(PolicyInputs(world_size, cluster_kind(cluster, world_size), balance=cfg.balance, speed=cfg.speed,
                                 replicate=cfg.replicate, page_budget=cfg.page_budget,
                                 powersgd_experts=cfg.powersgd_experts, token_split=cfg.token_split,
                                 chunks=cfg.chunks, device_type=device.type))
    num_chunks = policy.num_chunks  # None: measured once the model exists
    # -- end policy --

    # Before the model: the in-memory snapshots' headers carry the measured speeds a restore onto
    # another membership places the experts by when no checkpoint directory records them.
    snap = hooks.snapshotter(cfg, rank, world_size, cluster)  # in-memory snapshots (hetcomm.ops.snapshot)
    elastic_weights, placement_from, snap_record = elastic.placement(cfg, cluster, world_size, snap)
    if snap is not None:
        snap.weights = elastic_weights  # carried in each header: a restart on this membership keeps it
    # Speed-blind (--no-balance): equal weights; --speed oracle: the emulation's (speed_modes).
    initial_weights = speed_modes.placement_weights(cfg, cluster, world_size, elastic_weights)

    def make_moe(layer_index: int):
        return MoELayer(
            cfg.model_dim,
            cfg.experts,
            k=lm_cfg.k,
            capacity_factor=lm_cfg.capacity_factor,
            expert=expert_factory,
            cluster=cluster,
            replicate=cfg.replicate,
            calibrate=cfg.calibrate,
            wire_dtype=cfg.wire_dtype,
            seed=cfg.seed * 1000 + layer_index,
            page_budget=cfg.page_budget,
            token_split="auto" if cfg.token_split == "auto" else policy.token_split.on,  # auto: MeasuredLoop applies the lever
            num_chunks=num_chunks or 1,
            speed_every=speed_modes.layer_speed_every(cfg, MoEConfig.speed_every),  # 0: the given prior stays
            # The layer's default of 3 hot experts, but never more than the layer has (--experts 2).
            replicate_top=min(MoEConfig.replicate_top, cfg.experts),
            # --powersgd-experts: compression starts where the dense one does (make_powersgd).
            replicate_powersgd=cfg.powersgd_experts,
            replicate_powersgd_start=max(10, cfg.steps // 10),
            **elastic.placement_kwargs(initial_weights, cfg.experts, world_size),
        )

    torch.manual_seed(cfg.seed)  # dense weights identical on every rank
    model = MoETransformerLM(lm_cfg, make_moe)
    if cfg.speed == "oracle":
        speed_modes.apply_oracle(model.moe_layers, speed_modes.oracle_speeds(cluster, world_size))
    dense, expert = _split_parameters(model)
    if num_chunks is None:  # --chunks auto on a device: a short measurement decides (het_defaults)
        from hetcomm.train.het_defaults import measure_chunks

        probe = task.sample(cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))

        def probe_step() -> None:
            model(probe[:, :-1], probe[:, 1:])[1].backward()
            model.zero_grad(set_to_none=True)

        num_chunks, _ = measure_chunks(model.moe_layers, probe_step)
    opt = torch.optim.AdamW(dense + expert, lr=cfg.lr, weight_decay=0.0)
    if cfg.page_budget > 0:
        for m in model.moe_layers:
            m.attach_optimizer(opt)  # Adam's moments are paged with each expert
    job = _Rank(cfg, rank, world_size, cluster, task, model, opt,
                gen=torch.Generator().manual_seed(cfg.seed * 7919 + rank), dense=dense, extras={},
                policy=policy, snap=snap, snap_record=snap_record,
                placement_from=placement_from, expert_clock=expert_clock)
    _add_levers(job)
    return job


def _add_levers(job: _Rank) -> None:
    """The balancing levers the policy turned on and the state they checkpoint
    (:mod:`hetcomm.moe.policy`, :mod:`hetcomm.moe.measured_loop`, :mod:`hetcomm.train.balance`)."""
    from hetcomm.moe.measured_loop import MeasuredLoop
    from hetcomm.ops.checkpoint import PerRank
    from hetcomm.train.balance import ReplicaPowerSGD, TrainBalancer, make_powersgd

    cfg, rank, world_size, cluster, model = job.cfg, job.rank, job.world_size, job.cluster, job.model
    # The migration balancer runs with --balance only (the policy's migrations lever).
    if job.policy.migrations.on:
        from hetcomm.moe.placement.balancer import BalancerConfig
        from hetcomm.topo.compute import rank_speeds

        # The datasheet is the prior; each plan packs by the layers' measured vector once agreed.
        job.balancer = TrainBalancer(model, job.opt, rank_speeds(cluster, range(world_size)),
                                     BalancerConfig(every=cfg.balance_every, cooldown=cfg.balance_cooldown),
                                     flops_per_token=6 * 2 * cfg.model_dim * cfg.hidden_dim)
        job.extras["balancer"] = job.balancer
    # The per-step work after the optimizer, as any loop runs it (the cold move when the policy
    # turned it on). A placement changed at run time travels with every checkpoint and snapshot:
    # a restore re-places the layers before their experts load (the balancer carries its own map).
    job.measured = MeasuredLoop(model.moe_layers, job.opt, policy=job.policy, planner=job.balancer)
    job.policy = job.measured.policy  # given speeds have their verdict already: the record says so
    job.extras.update(job.measured.extras())
    if cfg.powersgd_rank:
        job.psgd = make_powersgd(cluster, world_size, cfg.powersgd_rank, cfg.seed, cfg.steps)
        job.extras["powersgd"] = PerRank(job.psgd, rank)  # each leader's own error feedback, not one rank's
    if cfg.powersgd_experts:
        job.extras["powersgd_experts"] = PerRank(ReplicaPowerSGD(model), rank)


def _start(job: _Rank, start_step: int, resumed_from: Optional[str], cause: Optional[str] = None,
           down_s: Optional[float] = None) -> None:
    """After the restore: a migration in flight at the save restarts, the warm-up seeds, the
    counters start, and the metrics, progress and probe open (with the membership record;
    ``cause`` and ``down_s``: why the membership changed and the seconds from the last finished
    step to the restored state, when this process knows: an in-place shrink)."""
    import hetcomm
    from hetcomm.ops import hooks

    cfg, rank, world_size, cluster, model = job.cfg, job.rank, job.world_size, job.cluster, job.model
    if job.balancer is not None and start_step:
        job.balancer.resume_pending()  # a migration in flight at the save starts again from the loaded weights
    hooks.warmup(cfg, model, start_step)
    hetcomm.reset_stats()
    job.progress = Progress(rank == 0, cfg, world_size, cluster, job.balancer, detected=cfg.cluster == DETECT)
    job.mc = hooks.metrics_collector(cfg, rank, world_size, cluster, model, start_step, resumed_from)
    job.mc.event(start_step, "policy", job.policy.line())  # the levers and why, before the first step
    job.start_step = start_step
    job.change, job.probe = elastic.start(cfg, rank, world_size, cluster, model, start_step, job.mc,
                                          job.placement_from, job.snap_record, job.snap, cause=cause,
                                          down_s=down_s)


def _finish(job: _Rank, t0: float) -> int:
    """The end of training: pending checkpoints and snapshots closed, the summary (collective)
    printed by rank 0. Returns the exit code of the loss verdict."""
    from hetcomm.ops import hooks
    from hetcomm.ops.membership import expert_census
    from hetcomm.ops.membership import summary_rows as membership_rows
    from hetcomm.train.expert_time import ExpertCpuClock
    from hetcomm.train.het_defaults import moe_time_summary
    from hetcomm.train.speed_modes import speed_record

    cfg, rank, world_size, model = job.cfg, job.rank, job.world_size, job.model
    hooks.finish_checkpoints(job.mc)  # --checkpoint-async: the last one is committed before the summary
    snap_rows = hooks.close_snapshots(job.snap, job.mc, cfg.steps, len(job.losses), time.perf_counter() - t0)
    job.mc.close()
    job.probe.close()
    if job.balancer is not None:
        job.balancer.finish_pending()

    elapsed = time.perf_counter() - t0
    # Which levers were on opens the summary (the policy's rows); these say what they did.
    het_rows = [("placement by speed (measured busy time evened once per layer)", job.measured.cold.summary()),
                ("per-rank MoE time max/mean", moe_time_summary(model.moe_layers)),
                ("expert FFN share (fwd + bwd)", ExpertCpuClock.summary(job.expert_clock.gather(world_size))),
                *snap_rows,
                *membership_rows(job.change, expert_census(model))]  # collective: the census
    compression = compression_per_rank(job.psgd, model, cfg, rank, world_size)  # collective
    summary = summarise(rank, world_size, cfg, job.cluster, job.task, model, job.losses, elapsed,
                        job.tokens_per_step, job.balancer, job.psgd, het_rows, detected=cfg.cluster == DETECT,
                        policy=job.policy)
    summary.update(compression, losses=list(job.losses), process_groups=group_backends(),
                   speed_decisions=speed_record(model.moe_layers, job.measured.cold))
    _LAST_SUMMARY[:] = [summary]
    hooks.record_verdict(cfg, rank, summary)
    if rank == 0:
        job.progress.close()
        print(summary["text"])
    return 0 if summary["ok"] else 1


# -- reporting ------------------------------------------------------------------------------

_LAST_SUMMARY: List[Dict[str, Any]] = []


def last_summary() -> Optional[Dict[str, Any]]:
    """The summary of the last run this process trained (every rank keeps its own), for callers
    that run :func:`train_worker` in-process (tests, benchmarks): ``ok``, ``text``, ``first``,
    ``last``, ``losses`` (per step, the mean over ranks), ``process_groups`` (this rank's groups'
    backends), ``speed_decisions`` (:func:`hetcomm.train.speed_modes.speed_record`), ``powersgd_ranks`` with ``--powersgd`` and ``replica_grad_ranks`` with replication
    (one dict per rank, :func:`hetcomm.train.summary.compression_per_rank`)."""
    return _LAST_SUMMARY[0] if _LAST_SUMMARY else None
