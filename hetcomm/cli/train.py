"""``hetcomm train``: the main job — a small MoE language model trained over hetcomm.

On one machine it spawns one process per rank of the cluster YAML (4 for mixed-mini); under
torchrun it joins the job instead. Prints a progress line (step, loss, tokens/s, all-to-all bytes
per rail, expert load, replicas) and a summary table; exits 1 if the loss did not fall well below
the unigram baseline.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Optional

from hetcomm.wire_dtypes import LAYER_SPELLINGS

if TYPE_CHECKING:  # the loop imports torch: loaded when a job runs, not for --help
    from hetcomm.train.loop import TrainConfig

DEFAULT_CONFIG = "configs/train/demo.yaml"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_path(path: str) -> str:
    """``path`` as given if it exists, else relative to the source checkout (for ``configs/...``)."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    candidate = os.path.join(_REPO_ROOT, path)
    return candidate if os.path.exists(candidate) else path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train the demo MoE language model over hetcomm",
        description="Train a small MoE transformer LM on a synthetic task, expert-parallel over hetcomm.",
    )
    p.add_argument("--config", default=None, help=f"train config YAML (default: {DEFAULT_CONFIG} if present)")
    p.add_argument(
        "--cluster",
        default=None,
        help="cluster YAML (rank placement, strong ranks, wire dtypes), or 'detect': no file, probe every "
        "host and run on the detected cluster (default: the train config's, configs/clusters/mixed-mini.yaml)",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--experts", type=int, default=None, help="experts per MoE layer")
    p.add_argument("--replicate", dest="replicate", action="store_true", default=None, help="replicate hot experts on strong ranks")
    p.add_argument("--no-replicate", dest="replicate", action="store_false", help="no hot-expert replication")
    p.add_argument("--calibrate", dest="calibrate", action="store_true", default=None, help="load-aware gate calibration (default on)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false", help="plain top-k gate")
    p.add_argument("--wire-dtype", choices=LAYER_SPELLINGS, default=None, help="dtype of routed activations on the wire")
    p.add_argument("--backend", choices=("hetcomm", "gloo"), default=None, help="process-group backend")
    p.add_argument("--nprocs", type=int, default=None, help="local ranks to spawn (default: the cluster's rank count)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--metrics", metavar="FILE.jsonl", default=None, help="write one record per step (see docs/OPERATIONS.md)")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="sharded checkpoints (torch.distributed.checkpoint) here")
    p.add_argument("--checkpoint-every", metavar="N", type=int, default=None, help="save a checkpoint every N steps")
    p.add_argument("--keep-checkpoints", metavar="N", type=int, default=None,
                   help="keep the N newest checkpoints in --checkpoint-dir, deleting older ones once a newer one is "
                   "complete (default 3; 0: keep all)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--snapshot-every", metavar="N|auto", default=None,
                   help="in-memory snapshot (node-local shared memory + a peer node) every N steps; 0: none; "
                   "auto (default): every step under torchrun / hetcomm launch, none otherwise (docs/OPERATIONS.md)")
    p.add_argument("--no-snapshot-peer", dest="snapshot_peer", action="store_false", default=None,
                   help="keep snapshots in this node's shared memory only (no copy on a peer node)")
    p.add_argument("--shrink-in-place", action="store_true", default=None,
                   help="torch >= 2.14, one machine: when a rank dies the survivors drop it with dist.shrink_group "
                   "and go on in the same processes from the in-memory snapshots (docs/OPERATIONS.md)")
    p.add_argument("--grow-back", action="store_true", default=None,
                   help="with --shrink-in-place: the launcher starts a replacement in a killed rank's slot and the "
                   "survivors take it back in (dist._reconfigure) at an agreed step (docs/OPERATIONS.md)")
    p.add_argument("--checkpoint-async", action="store_true", default=None,
                   help="write the --checkpoint-every checkpoints in the background (DCP async_save)")
    p.add_argument("--warmup-from", metavar="METRICS.jsonl", default=None, help="seed calibrators and hot experts from a previous run's metrics")
    p.add_argument("--balance", action="store_true", default=None,
                   help="also run the expert balancer: migrations by measured speed (default: only the one-time "
                   "placement by speed, each layer's experts re-placed to even the measured busy time when "
                   "the ranks differ beyond noise; docs/MOE.md)")
    p.add_argument("--no-balance", dest="no_balance", action="store_true", default=False,
                   help="speed-blind: no decision reads a speed -- equal contiguous expert placement, nothing "
                   "measured, no migrations, no placement by speed, no per-step token split")
    p.add_argument("--speed", choices=("measured", "datasheet", "oracle"), default=None,
                   help="rank speeds for balancing: measured on the ranks (default), the datasheet's "
                   "(decisions then depend on the data only: runs repeat bit for bit), or oracle: the "
                   "emulation's compute factors from the cluster file (emulation.compute_scale; a benchmark aid)")
    p.add_argument("--token-split", choices=("on", "off", "auto"), default=None,
                   help="per-step, time-proportional split of hot experts' rows among their copies by measured "
                   "speed (default auto: on once the ranks' agreed speeds differ; docs/MOE.md)")
    p.add_argument("--chunks", metavar="N|auto", default=None,
                   help="pipelined dispatch chunks per MoE layer (default auto: 1 on CPU ranks; docs/MOE.md)")
    p.add_argument("--balance-every", metavar="N", type=int, default=None, help="steps between balancer plans (default 50)")
    p.add_argument("--balance-cooldown", metavar="N", type=int, default=None,
                   help="steps before a moved expert may move again (default 1000)")
    p.add_argument("--powersgd", metavar="RANK", type=int, default=None,
                   help="PowerSGD of this rank for the dense gradients on cross-node pairs (0/absent: off)")
    p.add_argument("--powersgd-experts", metavar="RANK", type=int, default=None,
                   help="PowerSGD of this rank for the hot-expert replicas' gradient sums on cross-node pairs, "
                   "exact inside a node (0/absent: off; needs replication; docs/MOE.md)")
    p.add_argument("--probe-every", metavar="N", type=int, default=None,
                   help="in-training health probe every N steps: each rank's expert compute and links against its "
                   "device/link class, in the health records beside --metrics (default 50; 0: off; docs/OPERATIONS.md)")
    p.add_argument("--page-budget", metavar="FRACTION", type=float, default=None,
                   help="expert paging: keep this fraction of each rank's experts on the device, page the rest in "
                   "from a host pool as the gate routes (e.g. 0.4; 0/absent: off; docs/MOE.md)")
    return p


def _chunks(value):
    """``--chunks``: a positive integer or ``auto`` (None: the config's)."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        from hetcomm.errors import ConfigError

        raise ConfigError(f"--chunks takes a positive integer or 'auto', got {value!r}", key="train.chunks") from None


def _check_chunks(cfg: "TrainConfig", *, from_flag: bool, config_path: Optional[str]) -> None:
    """At most one dispatch chunk per expert of a layer, checked before any rank starts.

    A chunk groups each rank's local experts (``hetcomm.moe.routing.ChunkLayout``) and travels in
    its own exchange; no rank can hold more than the layer's experts, whatever the placement or
    the balancer does, so chunks beyond that are empty exchanges: ``--chunks 100000`` made every
    step wait on 100000 of them per layer and two steps never finished."""
    from hetcomm.errors import ConfigError, UsageError

    if cfg.chunks == "auto" or cfg.chunks <= cfg.experts:
        return
    why = (f"more than the {cfg.experts} experts of a layer (a chunk groups a rank's experts and no rank holds "
           f"more than {cfg.experts}: the extra chunks are empty exchanges every step)")
    if from_flag:
        raise UsageError(f"--chunks {cfg.chunks}: {why}; use --chunks {cfg.experts} or fewer, or --chunks auto")
    raise ConfigError(f"{cfg.chunks} is {why}; set chunks to {cfg.experts} or fewer, or auto",
                      path=config_path, key="chunks")


def _snapshot_every(value):
    """``--snapshot-every``: a whole number >= 0 or ``auto`` (None: the config's)."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        from hetcomm.errors import ConfigError

        raise ConfigError(f"--snapshot-every takes a whole number >= 0 or 'auto', got {value!r}",
                          key="train.snapshot_every") from None


def run(args: argparse.Namespace) -> int:
    from hetcomm.cli._args import check_nprocs
    from hetcomm.train.loop import launch

    check_nprocs(args.nprocs)  # 0 used to mean "the default" (4 ranks) silently
    return launch(train_config(args), nprocs=args.nprocs)


def train_config(args: argparse.Namespace):
    """The job's ``TrainConfig`` from the parsed flags (also what ``hetcomm launch`` checks before
    torchrun starts: a bad config or override is exit 2 there, not a worker failure)."""
    from hetcomm.errors import UsageError
    from hetcomm.train.loop import TrainConfig, load_train_config

    overrides = dict(
        cluster=args.cluster,
        steps=args.steps,
        experts=args.experts,
        replicate=args.replicate,
        calibrate=args.calibrate,
        wire_dtype=args.wire_dtype,
        backend=args.backend,
        seed=args.seed,
        metrics=args.metrics,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        warmup_from=args.warmup_from,
        balance=args.balance,
        speed=args.speed,
        balance_every=args.balance_every,
        balance_cooldown=args.balance_cooldown,
        powersgd_rank=args.powersgd,
        powersgd_experts=args.powersgd_experts,
        page_budget=args.page_budget,
        probe_every=args.probe_every,
        chunks=_chunks(args.chunks),
        snapshot_every=_snapshot_every(args.snapshot_every),
        snapshot_peer=args.snapshot_peer,
        checkpoint_async=args.checkpoint_async,
        shrink_in_place=args.shrink_in_place,
        token_split={"on": True, "off": False, "auto": "auto", None: None}[args.token_split],
    )
    if args.no_balance:
        if args.balance:
            from hetcomm.errors import ConfigError

            raise ConfigError("--balance and --no-balance contradict each other; pass one", key="train.balance")
        if args.token_split in ("on", "auto"):
            from hetcomm.errors import ConfigError

            raise ConfigError("--token-split and --no-balance contradict each other; pass one", key="train.token_split")
        overrides.update(balance=False, token_split=False)
    if args.cluster:
        overrides["cluster"] = args.cluster if args.cluster == "detect" else repo_path(args.cluster)
    config_path = repo_path(args.config) if args.config else None
    if config_path is None and os.path.exists(repo_path(DEFAULT_CONFIG)):
        config_path = repo_path(DEFAULT_CONFIG)
    if config_path:
        cfg = load_train_config(config_path, **overrides)
    else:
        from dataclasses import replace

        cfg = replace(TrainConfig(), **{k: v for k, v in overrides.items() if v is not None})
    if args.grow_back:
        if not cfg.shrink_in_place:
            raise UsageError("--grow-back takes a killed rank's slot back after an in-place shrink; add "
                             "--shrink-in-place (torch >= 2.14, one machine), or drop --grow-back")
        from dataclasses import replace

        cfg = replace(cfg, grow_back=True)
    _check_chunks(cfg, from_flag=args.chunks is not None, config_path=config_path)
    given = [flag for flag, v in (("--balance-every", args.balance_every), ("--balance-cooldown", args.balance_cooldown))
             if v is not None]
    if given and cfg.balance is not True:  # they used to be ignored silently
        raise UsageError(f"{' and '.join(given)} only apply with the balancer; add --balance or drop them")
    return cfg
