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
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from hetcomm._yaml import load_yaml, reject_unknown_keys
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import CLUSTER_ENV, load_cluster
from hetcomm.wire_dtypes import LAYER_SPELLINGS, parse_wire_dtype
from hetcomm.train.data import MarkovTask
from hetcomm.train.lm import LMConfig, MoETransformerLM

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
        resume: continue from ``checkpoint_dir``'s latest checkpoint when there is one.
        balance: run the expert balancer (:mod:`hetcomm.train.balance`): migrations between ranks.
        balance_every / balance_cooldown: steps between plan evaluations / before an expert
            that moved may move again.
        powersgd_rank: PowerSGD rank for the dense gradients on cross-node pairs (0: off).
        warmup_from: a previous run's metrics file: seeds calibrators and hot experts before the
            first step (``hetcomm launch`` phase 2), or None.
        page_budget: expert paging (``MoEConfig.page_budget``): the fraction of each rank's
            experts kept on the device, the rest paged in from a host pool as routed (0: off).
        token_split: per-step, time-proportional split of hot experts' rows among their copies
            by measured speed (:mod:`hetcomm.train.het_defaults`): False (default), True, or
            ``auto`` (on for a mixed cluster).
        chunks: pipelined dispatch chunks (``MoEConfig.num_chunks``), or ``auto``.
        probe_every: steps per window of the in-training health probe (:mod:`hetcomm.ops.probe`:
            each rank's expert compute and links judged against its device/link class, written
            to the health records beside ``metrics`` / in the launch directory; 0: off).
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
    resume: bool = False
    balance: bool = False
    balance_every: int = 50
    balance_cooldown: int = 1000
    powersgd_rank: int = 0
    warmup_from: Optional[str] = None
    page_budget: float = 0.0
    token_split: Union[bool, str] = False
    chunks: Union[int, str] = "auto"
    probe_every: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"must be a whole number >= 0, got {self.checkpoint_every!r}", key="train.checkpoint_every")
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
        for name in ("balance_every", "balance_cooldown", "powersgd_rank", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "balance_every" else 0):
                raise ConfigError(f"must be a whole number >= {1 if name == 'balance_every' else 0}, got {value!r}",
                                  key=f"train.{name}")
        if self.experts < 2:
            raise ConfigError("an MoE layer needs at least 2 experts", key="train.experts")
        pb = self.page_budget
        if isinstance(pb, bool) or not isinstance(pb, (int, float)) or not 0.0 <= pb <= 1.0:
            raise ConfigError(f"must be a fraction within [0, 1] (0 = paging off), got {pb!r}", key="train.page_budget")
        if self.token_split not in (True, False, "auto"):
            raise ConfigError(f"must be true, false or 'auto', got {self.token_split!r}", key="train.token_split")
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
    limit_s = cfg.timeout_s + cfg.steps * 10.0
    outcome = launch_ranks(
        _rank_main,
        world_size,
        args=(cfg,),
        env={CLUSTER_ENV: None},  # the ranks get the cluster as an object (pg_options), not a variable
        store=True,
        store_timeout_s=cfg.timeout_s,
        timeout_s=limit_s,
        grace_s=0.0,  # one rank failed: the others would wait for it until their timeout
        clean_shm=True,
        name="train",
    )
    if outcome.timed_out:
        print(f"hetcomm train: the run exceeded its time limit ({limit_s:g} s); ranks {list(outcome.timed_out)} "
              "had not finished; stopped all ranks", file=sys.stderr)
        return 1
    if not outcome.ok:
        first = outcome.ranks[outcome.first_failure if outcome.first_failure is not None else outcome.failures[0].rank]
        usage = [r for r in outcome.ranks if r.error_type in _usage_error_names()]
        if usage:
            # Bad input the ranks found (a damaged checkpoint, nothing to train): one line, exit 2.
            # It is the cause even when a peer's report of the raising rank's exit came first.
            print(f"hetcomm train: error: {usage[0].error}", file=sys.stderr)
            return 2
        if first.traceback:
            print(first.traceback, file=sys.stderr, end="")
        print(f"hetcomm train: {first.describe()}; stopped the other ranks", file=sys.stderr)
        return 1
    return 0 if outcome.results[0] == 0 else 1


def _usage_error_names() -> set:
    """Class names of the errors that mean bad input (CLI exit 2), as a rank reports them."""
    from hetcomm.errors import UsageError

    names, todo = set(), [ConfigError, UsageError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


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


def train_worker(rank: int, world_size: int, cfg: TrainConfig) -> int:
    """Train on this rank; rank 0 prints progress and the summary. Returns the job's exit code."""
    import hetcomm  # noqa: F401  (registers the backend)
    from hetcomm.moe import MoELayer

    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only contend
    # Parsed once on this rank; the backend gets the object as an explicit option, which beats a
    # stray $HETCOMM_CLUSTER (cluster: detect passes an explicit None: the backend probes the hosts).
    cluster = None if cfg.cluster == DETECT else load_cluster(cfg.cluster)
    pg_options = None
    if cfg.backend == "hetcomm":
        from hetcomm.backends.options import HetcommOptions

        pg_options = HetcommOptions(cluster=cluster)
    dist.init_process_group(
        cfg.backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s),
        pg_options=pg_options,
    )
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


def _train(rank: int, world_size: int, cfg: TrainConfig, MoELayer, cluster=None) -> int:
    from hetcomm.moe import MoEConfig

    cluster = _job_cluster(cfg, cluster)
    task = MarkovTask(vocab_size=256, seed=1234 + cfg.seed)
    lm_cfg = LMConfig(
        vocab_size=task.vocab_size,
        seq_len=cfg.seq_len,
        model_dim=cfg.model_dim,
        num_layers=cfg.layers,
        num_experts=cfg.experts,
        hidden_dim=cfg.hidden_dim,
    )

    def expert_factory(dim: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(dim, cfg.hidden_dim), torch.nn.GELU(), torch.nn.Linear(cfg.hidden_dim, dim)
        )

    from hetcomm.train.het_defaults import MoETimeTracker, resolve_chunks, token_split_default

    split_on = token_split_default(cfg.token_split, cfg.replicate, cluster, world_size) and cfg.page_budget == 0
    num_chunks, _ = resolve_chunks(cfg.chunks, torch.device("cpu"))  # the demo LM runs on CPU ranks

    elastic_weights, placement_from = _elastic_placement(cfg, cluster, world_size)

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
            token_split=split_on,
            num_chunks=num_chunks,
            # The layer's default of 3 hot experts, but never more than the layer has (--experts 2).
            replicate_top=min(MoEConfig.replicate_top, cfg.experts),
            **_placement_kwargs(elastic_weights, cfg.experts, world_size),
        )

    torch.manual_seed(cfg.seed)  # dense weights identical on every rank
    model = MoETransformerLM(lm_cfg, make_moe)
    dense, expert = _split_parameters(model)
    opt = torch.optim.AdamW(dense + expert, lr=cfg.lr, weight_decay=0.0)
    paged = cfg.page_budget > 0
    if paged:
        for m in model.moe_layers:
            m.attach_optimizer(opt)  # Adam's moments are paged with each expert
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)

    import hetcomm

    from hetcomm.ops import hooks

    # --balance / --powersgd (hetcomm.train.balance): their state is checkpointed with the model.
    from hetcomm.train.balance import TrainBalancer, make_powersgd

    balancer = psgd = None
    extras: Dict[str, Any] = {}
    if cfg.balance:
        from hetcomm.moe.placement.balancer import BalancerConfig
        from hetcomm.topo.compute import rank_speeds

        balancer = TrainBalancer(model, opt, rank_speeds(cluster, range(world_size)),
                                 BalancerConfig(every=cfg.balance_every, cooldown=cfg.balance_cooldown),
                                 flops_per_token=6 * 2 * cfg.model_dim * cfg.hidden_dim)
        extras["balancer"] = balancer
        expert = expert + balancer.spare_parameters()  # a spare may hold an expert later
    if cfg.powersgd_rank:
        psgd = make_powersgd(cluster, world_size, cfg.powersgd_rank, cfg.seed, cfg.steps)
        from hetcomm.ops.checkpoint import PerRank

        extras["powersgd"] = PerRank(psgd, rank)  # each leader's own error feedback, not one rank's
    start_step = hooks.resume(cfg, model, opt, gen, extras or None)
    if start_step >= cfg.steps:  # nothing left to train: report the recorded verdict, not a fresh one
        return hooks.nothing_to_train(cfg, rank, start_step)
    if balancer is not None and start_step:
        balancer.resume_pending()  # a migration in flight at the save starts again from the loaded weights
    hooks.warmup(cfg, model, start_step)
    hetcomm.reset_stats()
    progress = _Progress(rank == 0, cfg, world_size, cluster, balancer)
    mc = hooks.metrics_collector(cfg, rank, world_size, cluster, model, start_step)
    change, probe = _elastic_start(cfg, rank, world_size, cluster, model, start_step, mc, placement_from)
    t0 = time.perf_counter()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses: List[float] = []
    moe_time = MoETimeTracker()
    for step in range(start_step + 1, cfg.steps + 1):
        mc.start_step()
        batch = task.sample(cfg.batch_size, cfg.seq_len, gen)
        mc.mark("data")
        _, loss = model(batch[:, :-1], batch[:, 1:])
        aux = sum(m.l_aux for m in model.moe_layers)
        moe_time.observe(model.moe_layers)
        mc.mark("forward")
        opt.zero_grad(set_to_none=True)
        (loss + 0.01 * aux).backward()
        mc.mark("backward")
        for p in expert:  # the global loss is the mean over ranks: scale the expert-parallel grads
            if p.grad is not None:
                p.grad /= world_size
        if balancer is not None:
            balancer.after_backward()  # migrations started last step land; old owners computed this one
        if psgd is not None:
            for p in dense:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            psgd.all_reduce_mean([p.grad for p in dense])
        else:
            _allreduce_dense_grads(dense, world_size)
        mc.mark("grad_sync")
        opt.step()
        mc.mark("optimizer")
        for m in model.moe_layers:
            m.sync_replicas()
            m.end_page_step()  # after the refresh read the owners' weights: evictions, prefetch
        if balancer is not None:
            for line in balancer.after_step(step):
                mc.event(step, "migration", line)
        mc.mark("replica_sync")
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / world_size)
        mc.mark("loss_sync")
        mc.end_step(step, losses[-1], tokens_per_step * world_size)
        if paged and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            for m in model.moe_layers:
                m.sync_pages()  # the checkpoint reads the experts: no write-back half done
        if hooks.maybe_checkpoint(cfg, step, model, opt, gen, mc, extras or None):
            _elastic_after_checkpoint(cfg, rank, world_size, cluster, model)
        probe.after_step(step, model.moe_layers)
        progress.update(step, losses[-1], tokens_per_step * world_size, model)
    mc.close()
    probe.close()
    if balancer is not None:
        balancer.finish_pending()

    elapsed = time.perf_counter() - t0
    het_rows = [("token split (per step, by measured speed)", "on" if split_on else "off"),
                ("per-rank MoE time max/mean", MoETimeTracker.summary(moe_time.gather(world_size))),
                *_elastic_summary_rows(change, model)]
    summary = _summarise(rank, world_size, cfg, cluster, task, model, losses, elapsed, tokens_per_step,
                         balancer, psgd, het_rows)
    hooks.record_verdict(cfg, rank, summary)
    if rank == 0:
        progress.close()
        print(summary["text"])
    return 0 if summary["ok"] else 1


# -- elastic membership and the in-training probe (hetcomm.ops.membership, hetcomm.ops.probe) --


def _elastic_placement(cfg: TrainConfig, cluster, world_size: int):
    """Placement weights for a resume onto other ranks (measured speeds), or (None, "datasheet")."""
    from hetcomm.ops.membership import placement_weights

    return placement_weights(cfg, cluster, world_size)


def _placement_kwargs(weights, experts: int, world_size: int) -> Dict[str, Any]:
    """``MoELayer`` keyword arguments placing the experts by ``weights`` (none: the layer's own)."""
    if weights is None:
        return {}
    from hetcomm.moe.placement import place_experts

    return {"placement": place_experts(experts, world_size, rank_weights=weights)}


def _elastic_start(cfg: TrainConfig, rank: int, world_size: int, cluster, model, start_step: int, mc,
                   placement_from: str):
    """After the resume: the membership record/change (collective with a checkpoint directory)
    and the job's probe."""
    from hetcomm.ops.membership import on_start
    from hetcomm.ops.probe import probe_for

    change = on_start(cfg, rank, world_size, cluster, model, start_step, mc, placement_from)
    return change, probe_for(cfg, rank, world_size, cluster, model)


def _elastic_after_checkpoint(cfg: TrainConfig, rank: int, world_size: int, cluster, model) -> None:
    from hetcomm.ops.membership import after_checkpoint

    after_checkpoint(cfg, rank, world_size, cluster, model)


def _elastic_summary_rows(change, model) -> List[tuple]:
    """The summary's experts-present row (collective: the census) and the membership change."""
    from hetcomm.ops.membership import expert_census, summary_rows

    return summary_rows(change, expert_census(model))


# -- reporting ------------------------------------------------------------------------------


def _rail_bytes() -> Dict[str, int]:
    import hetcomm

    return {rail: int(c.get("bytes_sent", 0)) for rail, c in hetcomm.stats().items()}


def _fmt_bytes(n: float) -> str:
    # The one byte formatter of every command (hetcomm.units).
    from hetcomm.units import format_bytes

    return format_bytes(n)


class _Progress:
    """A one-line progress bar on a terminal; a line every ``log_every`` steps otherwise."""

    def __init__(self, enabled: bool, cfg: TrainConfig, world_size: int, cluster, balancer=None) -> None:
        self.enabled = enabled
        self.cfg = cfg
        self.balancer = balancer
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last_t = self.t0
        self.last_step = 0
        self.last_bytes: Dict[str, int] = {}
        if enabled:
            labels = ", ".join(
                f"rank{r}={cluster.rank(r).model}@{cluster.rank(r).node.name}" for r in range(world_size)
            )
            if cfg.cluster == DETECT:
                origin = (
                    f"; detected by probing every host (no cluster file): {len({n.name for n in cluster.nodes})} "
                    f"node(s), device kinds as the probe saw them"
                )
            else:
                origin = "; device kinds are labels on this CPU-only machine, the rails between the processes are real"
            print(f"hetcomm train: {world_size} ranks on cluster '{cluster.name}' ({labels}){origin}.", file=sys.stderr)

    def update(self, step: int, loss: float, tokens_per_step: int, model) -> None:
        if not self.enabled:
            return
        if not (self.tty or step % self.cfg.log_every == 0 or step == self.cfg.steps or step == 1):
            return
        now = time.perf_counter()
        steps = step - self.last_step
        tok_s = tokens_per_step * steps / max(now - self.last_t, 1e-9)
        rail_now = _rail_bytes()
        per_rail = {r: (b - self.last_bytes.get(r, 0)) / max(steps, 1) for r, b in rail_now.items()}
        self.last_t, self.last_step, self.last_bytes = now, step, rail_now
        st = model.moe_layers[0].step_stats()  # a StepStats
        top5 = st.global_top5_share if st.global_top5_share is not None else st.top5_share
        replicas = list(st.replicas)
        frac = step / self.cfg.steps
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        rails = " ".join(f"{r}:{_fmt_bytes(b)}" for r, b in sorted(per_rail.items())) or "-"
        line = (
            f"[{bar}] step {step}/{self.cfg.steps} loss {loss:.3f} {tok_s:,.0f} tok/s "
            f"a2a/step(rank0) {rails}"
            + (f" top5 {top5:.0%}" if isinstance(top5, float) else "")
            + (f" replicas {replicas}" if replicas is not None else "")
            + (f" migrations {self.balancer.migrations}" if self.balancer is not None else "")
            + (f" pages {_page_line(model)}" if self.cfg.page_budget else "")
        )
        if self.tty:
            print("\r" + line[:200].ljust(120), end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def _page_totals(model) -> Dict[str, float]:
    """This rank's pager counters summed over layers (cumulative; ``MoELayer.page_stats``)."""
    keys = ("hits", "waits", "stall_s", "loads", "evictions", "prefetches", "reacquires", "reacquire_stall_s",
            "slots", "experts")
    tot = {k: 0.0 for k in keys}
    for m in model.moe_layers:
        st = m.page_stats()
        for k in keys:
            tot[k] += st.get(k, 0)
    return tot


def _page_line(model) -> str:
    t = _page_totals(model)
    n = t["hits"] + t["waits"]
    rate = f"{t['hits'] / n:.1%}" if n else "-"
    return f"{rate} hit, stall {(t['stall_s'] + t['reacquire_stall_s']) * 1e3:.0f} ms"


def _page_row(cfg, model) -> str:
    t = _page_totals(model)
    n = t["hits"] + t["waits"]
    rate = f"{t['hits'] / n:.2%}" if n else "-"
    return (f"budget {cfg.page_budget:g} of each rank's experts ({int(t['slots'])} of {int(t['experts'])} expert slots "
            f"on rank0's device); {int(t['hits']):,} computations started without waiting, {int(t['waits']):,} "
            f"faulted ({rate} hits); stall {(t['stall_s'] + t['reacquire_stall_s']):.2f} s; {int(t['loads']):,} loads, "
            f"{int(t['evictions']):,} evictions, {int(t['prefetches']):,} prefetches, {int(t['reacquires']):,} "
            f"backward reloads (steps over budget)")


def _psgd_row(psgd) -> str:
    st = psgd.stats()
    if not st["compressed_bytes"]:
        return f"rank {psgd.state.matrix_approximation_rank if psgd.state else '-'}; no compressed step on rank 0"
    n = max(1, st["compressed_calls"])
    return (f"rank {psgd.state.matrix_approximation_rank}: {_fmt_bytes(st['compressed_bytes'] / n)} per step "
            f"instead of {_fmt_bytes(st['uncompressed_bytes'] / n)} on rank 0's leader links "
            f"({st['reduction']:.1f}x fewer)")


def _summarise(rank, world_size, cfg, cluster, task, model, losses, elapsed, tokens_per_step,
               balancer=None, psgd=None, het_rows=()) -> Dict[str, Any]:
    unigram = task.unigram_entropy()
    optimum = task.conditional_entropy()
    window = max(1, min(20, len(losses) // 5))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    # "Well below the unigram baseline": at least half-way from the baseline to the optimum.
    target = unigram - 0.5 * (unigram - optimum)
    ok = last <= target
    verdict = ("PASS: " if ok else "FAIL: ") + f"last loss {'<=' if ok else '>'} {target:.3f} (half-way to optimum)"
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:  # NaN compares false with everything: say what happened, not "last loss > x"
        ok = False
        verdict = (f"FAIL: the loss is {losses[bad]} from step {cfg.steps - len(losses) + 1 + bad} on (diverged): "
                   f"lower --lr, or check the checkpoint it resumed from")
    rails = _rail_bytes()
    layer = model.moe_layers[0]
    st = layer.step_stats()
    rows = [
        ("ranks", f"{world_size} ({', '.join(sorted({cluster.rank(r).model for r in range(world_size)}))}; "
                  f"{'detected, no cluster file' if cfg.cluster == DETECT else 'labels on CPU'})"),
        ("steps", f"{cfg.steps} in {elapsed:.1f} s"),
        ("tokens/s (all ranks)", f"{tokens_per_step * world_size * cfg.steps / elapsed:,.0f}"),
        ("loss first -> last", f"{first:.3f} -> {last:.3f} (mean of {window} steps)"),
        ("unigram baseline", f"{unigram:.3f}  (best context-free predictor)"),
        ("achievable optimum", f"{optimum:.3f}  (the chain's conditional entropy)"),
        ("verdict", verdict),
        ("replication / calibration", f"{'on' if cfg.replicate else 'off'} / {'on' if cfg.calibrate else 'off'}"),
        ("wire dtype", cfg.wire_dtype),
        *(balancer.summary_rows() if balancer is not None else []),
        *het_rows,
        *([("PowerSGD (cross-node pairs)", _psgd_row(psgd))] if psgd is not None else []),
        *([("paging (rank0)", _page_row(cfg, model))] if cfg.page_budget else []),
    ]
    for rail, c in sorted(rails.items()):
        rows.append((f"rank0 sent over {rail}", f"{_fmt_bytes(c)} ({_fmt_bytes(c / cfg.steps)}/step)"))
    labels = {
        "global_top5_share": "layer0 top-5 expert share",
        "global_min_expert_rate": "layer0 least-used expert share",
        "overflow_rate": "layer0 capacity overflow (rank0)",
        "local_fraction": "layer0 tokens computed locally (rank0)",
    }
    for key, label in labels.items():
        if isinstance(st.get(key), (int, float)):
            rows.append((label, f"{st[key]:.1%}"))
    if st.get("replicas") is not None:
        rows.append(("layer0 replicas on rank0", f"{list(st['replicas'])} (hot: {list(st.get('hot_experts', []))})"))
    if isinstance(st.get("a2a_bytes_sent"), (int, float)) and isinstance(st.get("a2a_bytes_sent_without_replication"), (int, float)):
        rows.append((
            "layer0 a2a bytes/step (rank0)",
            f"{_fmt_bytes(st['a2a_bytes_sent'])} sent; {_fmt_bytes(st['a2a_bytes_sent_without_replication'])} without replication",
        ))
    width = max(len(k) for k, _ in rows)
    text = "\n".join(["", "hetcomm train summary", "-" * (width + 40)] + [f"{k.ljust(width)}  {v}" for k, v in rows])
    return {"ok": ok, "text": text, "first": first, "last": last, "unigram": unigram, "optimum": optimum,
            "verdict": verdict}


