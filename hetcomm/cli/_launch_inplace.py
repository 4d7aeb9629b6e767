"""``hetcomm launch --shrink-in-place``: the job phase on hetcomm's own launcher instead of torchrun.

torchrun's agent stops every worker of its node when one fails, so under it the survivors of a
lost rank cannot shrink the group in place (:mod:`hetcomm.train.inplace`). With this flag a
one-machine ``train`` job's ranks run on :func:`hetcomm.launcher.launch`, as ``hetcomm train
--shrink-in-place`` runs them (:func:`hetcomm.train.local_ranks.launch_options`: the launcher
hosts the store, a dead rank stops nobody), each rank being the torchrun worker's own entry
(:func:`hetcomm.cli.launch_worker.in_place_rank`: end marks, grouped start, the job) with the
environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` from the launcher; the launch's directory, job id, nonce and owner from
``hetcomm launch``). The health check and warm-up run as without the flag; there are no restarts
(``--max-restarts`` does not apply): a failure other than a rank's death ends the job, exit 1.

Refused before anything starts (:func:`check`, exit 2): with ``--node`` (torchrun runs each node's
workers), on a torch without ``dist.shrink_group`` (< 2.14), for a job other than ``train``, and
for a train job on the ``gloo`` backend.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Dict, List

from hetcomm.errors import UsageError

__all__ = ["check", "check_config", "run_job"]

_RESTART = "drop --shrink-in-place: the job then runs under torchrun and a lost rank restarts it (--max-restarts)"


def check(args: argparse.Namespace, job: List[str]) -> List[str]:
    """Refuse ``--shrink-in-place`` where it cannot work; returns ``job`` (the argv after ``--``)
    with ``--shrink-in-place`` (and ``--grow-back`` when given) for the train job (unchanged
    without the flag).

    Raises:
        UsageError: with ``--node``, on torch < 2.14, or a job other than ``train``; naming the
            fix (the restart path); ``--grow-back`` without ``--shrink-in-place``.
    """
    if args.grow_back and not args.shrink_in_place:
        raise UsageError("--grow-back takes a dead rank's slot back after an in-place shrink; add --shrink-in-place "
                         "(one machine, torch >= 2.14, a train job), or drop --grow-back")
    if not args.shrink_in_place:
        return job
    if args.node is not None:
        raise UsageError(f"--shrink-in-place with --node {args.node}: an in-place shrink needs every rank under one "
                         "launcher on one machine (torchrun's agent stops every worker of a node when one fails); "
                         f"for a multi-node job {_RESTART}")
    if job[0] != "train":
        raise UsageError(f"--shrink-in-place applies to `train` jobs, not `{job[0]}`; drop it")
    from hetcomm.backends.reconfigure import supported

    if not supported():
        import torch

        raise UsageError(f"--shrink-in-place needs torch >= 2.14 (dist.shrink_group); this is torch "
                         f"{torch.__version__}: {_RESTART}")
    job = job if "--shrink-in-place" in job else job + ["--shrink-in-place"]
    return job + ["--grow-back"] if args.grow_back and "--grow-back" not in job else job


def check_config(job: List[str]):
    """The train job's ``TrainConfig`` (``job``: the checked argv, ``--cluster`` set); refuses a
    backend that cannot shrink (gloo: the job would run with the flag off)."""
    from hetcomm.cli.main import build_parser
    from hetcomm.cli.train import train_config

    cfg = train_config(build_parser().parse_args(job))
    if cfg.backend != "hetcomm":
        raise UsageError(f"--shrink-in-place needs the hetcomm backend (the job runs on {cfg.backend}); "
                         f"give the job --backend hetcomm, or {_RESTART}")
    return cfg


def _signal_name(code) -> str:
    """``SIGTERM`` for the launcher's ``SystemExit(128 + signal)``."""
    import signal

    try:
        return signal.Signals(int(code) - 128).name
    except (TypeError, ValueError):
        return f"exit {code}"


def run_job(job: List[str], cfg, nproc: int, env: Dict[str, str]) -> int:
    """Run the job's ``nproc`` ranks on hetcomm's launcher and return the launch's exit code:
    after an in-place shrink the lowest survivor's verdict, with one line naming the ranks that
    died and those that finished in place (:func:`hetcomm.train.local_ranks.exit_code`)."""
    from hetcomm.cli.launch_worker import in_place_rank
    from hetcomm.launcher import launch
    from hetcomm.train.local_ranks import exit_code, launch_options

    opts = replace(launch_options(cfg, in_place=True), args=(job,), env=env, name="launch")
    print(f"hetcomm launch: starting the job on this machine under hetcomm's launcher (--shrink-in-place: a lost "
          f"rank's survivors go on in place; no restarts): {' '.join(job)}", file=sys.stderr, flush=True)
    try:
        outcome = launch(in_place_rank, nproc, opts)
    except (SystemExit, KeyboardInterrupt) as e:
        # The launcher forwarded SIGTERM/SIGINT to every rank and stopped them (SIGKILL after its
        # grace); the launch ends 128 + signal as on the torchrun path, saying so.
        name = "SIGINT" if isinstance(e, KeyboardInterrupt) else _signal_name(e.code)
        print(f"hetcomm launch: {name} received during the job; stopped every rank", file=sys.stderr, flush=True)
        raise
    return exit_code(outcome, True, who="hetcomm launch")
