"""What ``hetcomm launch`` runs in every torchrun worker: place the rank, stagger, run the job.

    python -m hetcomm.cli.launch_worker [hetcomm subcommand and its arguments]

(the entry point is :mod:`hetcomm.cli.launch_worker`, which hands the CLI's parser to :func:`main`:
``ops`` does not import the floor above it).

torchrun numbers nodes in rendezvous order, not in the cluster YAML's order, and a node left out
by the health check is simply absent. A cluster YAML places ranks by position, so before the
process group exists each worker:

0. (rank 0) hosts the rendezvous round's store when torchrun's agent does not
   (:func:`round_store`; ``hetcomm launch`` turns torch's store sharing off across nodes);
1. publishes its node's name (``HETCOMM_NODE``, set by that node's ``hetcomm launch --node``)
   under its torchrun node rank (``GROUP_RANK``) in torchrun's own store, reads every node's,
   and writes the cluster YAML *of this job*: the nodes that joined, in torchrun's order
   (:func:`hetcomm.ops.job_cluster.job_cluster_yaml`); ``HETCOMM_CLUSTER`` then points at it;
   without ``HETCOMM_NODE`` (one torchrun for the whole cluster, e.g. on one machine) the YAML
   is used as it is;
2. gives this attempt a store of its own (:func:`fresh_store`: a restart must not read the
   failed attempt's keys), then waits ``(RANK // HETCOMM_GROUP_SIZE) * HETCOMM_GROUP_DELAY`` seconds (grouped start: the
   ranks of a large job reach the store and the NICs in waves, not all at once);
3. runs ``hetcomm <args>`` in this process (``--cluster`` replaced by the job's YAML); see
   :func:`main` for how its exit code reaches ``hetcomm launch``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, List, Optional

__all__ = ["main", "round_store", "place", "fresh_store", "master_store", "NODE_ENV", "GROUP_SIZE_ENV", "GROUP_DELAY_ENV"]

from hetcomm import settings

if TYPE_CHECKING:
    import argparse

# The names, for callers that set them in a child environment (declared in hetcomm.settings).
NODE_ENV = settings.NODE.name
GROUP_SIZE_ENV = settings.GROUP_SIZE.name
GROUP_DELAY_ENV = settings.GROUP_DELAY.name


_ROUND_STORE: List[object] = []  # rank 0's store of this rendezvous round (round_store), alive with the worker
_ROUND: List[str] = []  # set by round_store: this round's tag for the keys below


def _attempt() -> str:
    """The tag of this attempt's keys in the store: the round's own store needs none of the
    restart count, which is per agent (a node that joins later counts from 0 while the others
    count their restarts); torchrun's shared store outlives attempts, so there it is the count."""
    return _ROUND[0] if _ROUND else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def round_store() -> None:
    """Host the rendezvous round's store on rank 0 when torchrun's agent does not.

    ``hetcomm launch`` turns torch's store sharing off on multi-node jobs (so that a node can join
    a later round, :mod:`hetcomm.cli.launch`): the round's rank 0 agent then only publishes a free
    port as ``MASTER_PORT`` and nothing listens there (``TORCHELASTIC_USE_AGENT_STORE=False``).
    Rank 0 hosts that store itself, for the whole attempt, and the steps below use it as they
    use the agent's (``TORCHELASTIC_USE_AGENT_STORE=True`` from here on). Each round has a store
    of its own, so no key of an earlier membership is read, and the keys are tagged by the round,
    not by the restart count (:func:`_attempt`: a returning node's agent counts from 0).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or "MASTER_PORT" not in os.environ:
        return
    import torch.distributed as dist

    if os.environ.get("RANK") == "0":
        _ROUND_STORE.append(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                                          wait_for_workers=False, timeout=timedelta(seconds=120)))
    _ROUND.append(f"round-{os.environ['MASTER_PORT']}")
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"


def master_store(timeout_s: float):
    """A client of the store at ``MASTER_ADDR:MASTER_PORT``: torchrun's agent's, or the one
    hetcomm's own launcher hosts (:mod:`hetcomm.launcher`, ``store=True``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def place(argv: List[str]) -> List[str]:
    """Step 1: the job's cluster YAML; returns ``argv`` with ``--cluster`` pointing at it."""
    from hetcomm.ops.job_cluster import job_cluster_yaml
    from hetcomm.topo.cluster import CLUSTER_ENV

    node = settings.NODE.get()
    full = settings.CLUSTER.get()
    if not node or not full:
        return argv
    group_rank = int(os.environ["GROUP_RANK"])
    num_nodes = int(os.environ["GROUP_WORLD_SIZE"])
    store = master_store(120.0)
    prefix = f"hetcomm/launch/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{_attempt()}/node/"
    if int(os.environ["LOCAL_RANK"]) == 0:
        store.set(prefix + str(group_rank), node)
    keys = [prefix + str(g) for g in range(num_nodes)]
    store.wait(keys, timedelta(seconds=120))
    order = [store.get(k).decode() for k in keys]
    text = job_cluster_yaml(full, order)
    from hetcomm.ops.safe_fs import check_private_dir, write_private

    out_dir = settings.LAUNCH_DIR.get()
    if out_dir:
        check_private_dir(out_dir, what="$HETCOMM_LAUNCH_DIR")
    else:  # a worker started by plain torchrun: a fresh private directory of its own
        import tempfile

        out_dir = tempfile.mkdtemp(prefix=f"hetcomm-cluster-{os.getuid()}-")  # 0700, a name nobody had
    path = os.path.join(out_dir, f"cluster-{'_'.join(order)}.yaml")
    write_private(path, text)  # every rank writes the same text: the last rename wins harmlessly
    os.environ[CLUSTER_ENV] = path
    args = list(argv)
    if "--cluster" in args:
        args[args.index("--cluster") + 1] = path
    else:
        args += ["--cluster", path]
    return args


def fresh_store() -> None:
    """Give this attempt's process group a store of its own (rank 0 hosts it on a free port).

    torchrun's workers share the agent's store across restarts, and its keys outlive a failed
    attempt: gloo's full-mesh connect of the restarted group then reads the dead workers'
    addresses and fails ("Connection refused"; plain gloo jobs hit it too on torch 2.13). Rank 0
    of each attempt publishes a free port under the attempt's own key; every rank points
    ``MASTER_PORT`` at it and lets rank 0 host the store (``TORCHELASTIC_USE_AGENT_STORE=False``),
    so each attempt starts from an empty store.

    Not under hetcomm's own launcher (``hetcomm launch --shrink-in-place``: no
    ``TORCHELASTIC_RUN_ID``): it runs one attempt, its store is empty when the ranks start, and
    it must stay in the launcher, which outlives any rank (the survivors of a lost rank 0 go on
    over it; a store in rank 0 would die with it).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import socket

    store = master_store(120.0)
    key = f"hetcomm/launch/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{_attempt()}/store_port"
    if os.environ.get("RANK") == "0":
        with socket.socket() as s:
            s.bind(("", 0))
            store.set(key, str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = store.get(key).decode()  # get waits for the key (store timeout)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def stagger() -> float:
    """Step 2: sleep for this rank's group; returns the seconds slept."""
    size = settings.GROUP_SIZE.get()
    delay = settings.GROUP_DELAY.get()
    if size <= 0 or delay <= 0:
        return 0.0
    wait = (int(os.environ.get("RANK", "0")) // size) * delay
    time.sleep(wait)
    return wait


def main(argv: Optional[List[str]] = None, *, build_parser: "Callable[[], argparse.ArgumentParser]", exit_usage: int,
         record_exit: bool = True) -> int:
    """Run the job; a *finished* job's exit code is recorded, not returned (unless ``record_exit``
    is False).

    torchrun restarts the workers when one exits non-zero, which is right for a crash (a dead
    peer, a collective error: they propagate from here with their traceback) but wrong for a
    job that ran to its end and whose check failed (``hetcomm train``'s loss verdict, exit 1) or
    whose input is bad (exit 2): a restart would only repeat it. Those codes are written to
    ``$HETCOMM_LAUNCH_DIR/job-exit`` by rank 0, the worker exits 0, and ``hetcomm launch``
    returns the recorded code.

    Args:
        argv: the hetcomm subcommand and its arguments (default ``sys.argv[1:]``).
        build_parser / exit_usage: the CLI's parser and usage exit code, passed in by the entry
            point :mod:`hetcomm.cli.launch_worker` (``ops`` does not import the floor above it).
        record_exit: False under hetcomm's own launcher (``hetcomm launch --shrink-in-place``),
            which restarts nobody and collects each rank's return value: the code is returned.
            (Recording it there is rank 0's job, and after an in-place shrink that lost rank 0
            no process has ``RANK=0``.)
    """
    EXIT_USAGE = exit_usage
    from hetcomm.errors import ConfigError, TopologyParseError, UsageError
    from hetcomm.ops.rank_marks import marked

    from hetcomm.ops.supervise import die_with_parent

    die_with_parent()  # a SIGKILLed agent must not leave this worker training on
    out = settings.LAUNCH_DIR.get()
    # This rank's end mark (done / failed, naming the peer a hetcomm error blames / stopped) lets
    # `hetcomm launch` name the rank at fault once torchrun gives up (hetcomm.ops.rank_marks).
    with marked(out, "job", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("RANK", "0")),
                settings.NODE.get() or ""):
        round_store()
        args = place(list(sys.argv[1:] if argv is None else argv))
        fresh_store()
        stagger()
        ns = build_parser().parse_args(args)
        try:
            code = int(ns._run(ns) or 0)
        except (UsageError, ConfigError, TopologyParseError) as e:
            print(f"hetcomm {ns.command}: error: {e}", file=sys.stderr)
            code = EXIT_USAGE
    if not record_exit:
        return code
    if out and os.environ.get("RANK", "0") == "0":
        from hetcomm.ops.safe_fs import write_private

        write_private(os.path.join(out, "job-exit"), f"{code}\n")
    return 0
