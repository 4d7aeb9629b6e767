"""``hetcomm emulate up|down|run|status``: an emulated heterogeneous cluster on one machine.

Examples::

    hetcomm emulate run --cluster configs/clusters/mixed-mini.yaml -- hetcomm bench alltoall
    hetcomm emulate up --cluster configs/clusters/emulated-4node.yaml --scale 1e-3
    hetcomm emulate status
    hetcomm emulate down                 # every emulation in the state dir
    hetcomm emulate down --sweep         # and hc<id>-* objects that are provably orphaned

See ``docs/EMULATE.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from typing import List, Optional

from hetcomm.errors import UsageError

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hetcomm emulate`` and its four actions."""
    p = subparsers.add_parser(
        "emulate",
        help="emulate a heterogeneous cluster with network namespaces and shaped veths (root)",
        description="Emulate a cluster YAML on this machine: one network namespace per node, "
        "veth pairs as NICs, tc tbf as link rates (scaled). Needs Linux and root.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--state-dir",
            default=None,
            metavar="DIR",
            help="where state files live (default /run/hetcomm/emulate)",
        )

    def shaping(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--cluster", metavar="YAML", help="cluster description (configs/clusters/*.yaml)"
        )
        sp.add_argument(
            "--scale",
            type=float,
            default=None,
            help="rate factor: a 200 Gb/s NIC becomes 200*scale Gb/s (default: "
            "emulation.scale of the YAML, else 1e-3)",
        )
        sp.add_argument(
            "--mode",
            choices=("bridge", "p2p"),
            default=None,
            help="bridge: NICs on per-rail bridges; p2p: one veth per node pair "
            "(default: emulation.mode of the YAML, else bridge)",
        )
        sp.add_argument(
            "--subnet", default=None, help="private IPv4 range (default: emulation.subnet)"
        )
        sp.add_argument(
            "--compute",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="emulate compute speed with a cpu cgroup per rank (default: emulation.compute, "
            "on when emulation.compute_scale is given)",
        )
        sp.add_argument(
            "--cpu-per-rank",
            type=float,
            default=None,
            metavar="CPUS",
            help="CPUs of one rank at speed 1 (default: emulation.cpu_per_rank, else this "
            "machine's cores / ranks, at most 1)",
        )

    up = actions.add_parser("up", help="create the namespaces, veths and shapers; print the run id")
    shaping(up)
    common(up)
    up.add_argument("--json", action="store_true", help="print the state as JSON")

    down = actions.add_parser("down", help="remove an emulation (all in the state dir by default)")
    down.add_argument("--id", dest="run_id", help="only this run id (hc3f9a1c or 3f9a1c)")
    down.add_argument(
        "--sweep",
        action="store_true",
        help="also remove hc<id>-* namespaces, /dev/shm dirs and cgroups that are provably "
        "orphaned (no state file anywhere known, no live process); says what it skips",
    )
    common(down)

    st = actions.add_parser("status", help="list emulations and what of them exists")
    st.add_argument("--id", dest="run_id", help="only this run id")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    common(st)

    run = actions.add_parser(
        "run", help="bring up (or reuse --id), run CMD once per rank, tear down"
    )
    shaping(run)
    common(run)
    run.add_argument("--id", dest="run_id", help="run in this existing emulation (not torn down)")
    run.add_argument("--keep", action="store_true", help="leave the emulation up afterwards")
    run.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the whole run may take (default 600); exit 3 when exceeded",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return p


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action; returns the exit code."""
    action = getattr(args, "action", None)
    if action is None:
        raise UsageError("missing action: use 'hetcomm emulate up|down|run|status' (see --help)")
    from hetcomm.emulate.kernel import check_prerequisites
    from hetcomm.emulate.state import DEFAULT_STATE_DIR, secure_state_dir

    if args.state_dir is None:
        args.state_dir = DEFAULT_STATE_DIR
    if action != "status":
        check_prerequisites()
    # What `down` deletes as root comes from this directory: it must be private.
    args.state_dir = (
        secure_state_dir(args.state_dir, create=action in ("up", "run")) or args.state_dir
    )
    return {"up": _up, "down": _down, "status": _status, "run": _run}[action](args)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _norm_id(run_id: str) -> str:
    rid = run_id[2:] if run_id.startswith("hc") else run_id
    if len(rid) != 6 or any(c not in "0123456789abcdef" for c in rid):
        raise UsageError(
            f"--id {run_id!r} is not a run id; ids look like hc3f9a1c (see 'hetcomm emulate "
            "status')"
        )
    return rid


def _plan_from_args(args: argparse.Namespace):
    from hetcomm.emulate.fabric import new_run_id
    from hetcomm.emulate.spec import plan_network, settings_from_cluster
    from hetcomm.topo.cluster import load_cluster

    if not args.cluster:
        raise UsageError(
            "--cluster YAML is required, e.g. --cluster configs/clusters/mixed-mini.yaml"
        )
    cluster = load_cluster(args.cluster)
    settings = settings_from_cluster(
        cluster,
        scale=args.scale,
        mode=args.mode,
        subnet=args.subnet,
        compute=args.compute,
        cpu_per_rank=args.cpu_per_rank,
    )
    return cluster, plan_network(cluster, settings, new_run_id())


def _up(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hetcomm.emulate.fabric import bring_up

    cluster, plan = _plan_from_args(args)
    state = bring_up(plan, state_dir=args.state_dir, cluster_path=cluster.path, progress=_log)
    if args.json:
        print(json.dumps(asdict(state), indent=1))
    else:
        _print_state(state, live=None)
        print(f"hc{state.run_id}")
    return EXIT_OK


def _down(args: argparse.Namespace) -> int:
    from hetcomm.emulate.fabric import leftovers, tear_down
    from hetcomm.emulate.orphans import find_unrecorded, remove_orphan
    from hetcomm.emulate.state import list_states, load_state, run_id_of, state_path
    from hetcomm.errors import ConfigError

    rid = _norm_id(args.run_id) if args.run_id else None
    states = []
    refused = 0
    if rid is not None:
        path = state_path(args.state_dir, rid)
        paths = [path] if os.path.lexists(path) else []
    else:
        paths = list_states(args.state_dir)
    for p in paths:
        try:
            states.append(load_state(p))
        except ConfigError as e:
            # Nothing of a state file that fails its checks is acted on.
            refused += 1
            _log(f"emulate: refusing {p}, nothing of it removed: {e}")
    if rid is not None and not paths and not args.sweep:
        # Without its state file, nothing proves the names are this run's.
        found = leftovers(rid)
        if not found:
            _log(f"emulate: no emulation hc{rid} in {args.state_dir}; nothing to remove")
            return EXIT_OK
        _log(
            f"emulate: no state file {state_path(args.state_dir, rid)}: nothing removed. Objects "
            f"named hc{rid}- exist ({', '.join(found)}); 'hetcomm emulate status' says whose they "
            f"are, and 'hetcomm emulate down --sweep --id hc{rid}' removes them if they are "
            "provably orphaned"
        )
        return EXIT_FINDINGS
    bad = 0
    for s in states:
        problems = tear_down(s, state_dir=args.state_dir)
        if problems:
            bad += 1
            _log(f"emulate: hc{s.run_id}: NOT fully removed: " + "; ".join(problems))
        else:
            _log(
                f"emulate: hc{s.run_id} ({s.cluster_name}) removed: {len(s.namespaces)} "
                "namespaces, "
                f"{len(s.cgroups)} cgroups recorded"
            )
    if args.sweep:
        known = {run_id_of(p) for p in list_states(args.state_dir)} | {s.run_id for s in states}
        unrecorded = find_unrecorded([args.state_dir], {k for k in known if k}, only=rid)
        for u in unrecorded:
            if not u.orphan:
                _log(f"emulate: sweep skips hc{u.run_id}: {u.reason()}")
                continue
            problems = remove_orphan(u)
            if problems:
                bad += 1
                _log(f"emulate: orphan hc{u.run_id}: NOT fully removed: " + "; ".join(problems))
            else:
                _log(f"emulate: orphan hc{u.run_id} removed: {', '.join(u.objects)}")
        if not unrecorded:
            _log("emulate: sweep found no hc<id>-* objects outside the recorded emulations")
    elif not states and not refused:
        _log(
            f"emulate: nothing to remove (no state files in {args.state_dir}; --sweep removes "
            "provable orphans)"
        )
    if rid is None:
        # Logs kept by failed runs whose emulation is already gone (inside the private dir).
        import shutil

        recorded = {run_id_of(p) for p in list_states(args.state_dir)}
        try:
            for n in os.listdir(args.state_dir):
                if re.fullmatch(r"hc[0-9a-f]{6}", n) and n[2:] not in recorded:
                    shutil.rmtree(os.path.join(args.state_dir, n), ignore_errors=True)
        except OSError:
            pass
    if refused:
        return EXIT_USAGE
    return EXIT_FINDINGS if bad else EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hetcomm.emulate.kernel import list_netns
    from hetcomm.emulate.orphans import find_unrecorded
    from hetcomm.emulate.state import list_states, load_state, run_id_of, state_path
    from hetcomm.errors import ConfigError

    paths = list_states(args.state_dir)
    rid = _norm_id(args.run_id) if args.run_id else None
    if rid is not None:
        paths = [p for p in paths if p == state_path(args.state_dir, rid)]
    try:
        live = set(list_netns())
    except OSError:
        live = set()
    states, refused = [], []
    for p in paths:
        try:
            states.append(load_state(p))
        except ConfigError as e:
            refused.append(f"refused {p}: {e}")
    known = {run_id_of(p) for p in list_states(args.state_dir)}
    unrecorded = find_unrecorded([args.state_dir], {k for k in known if k}, only=rid)
    if args.json:
        print(
            json.dumps(
                {
                    "state_dir": args.state_dir,
                    "emulations": [
                        dict(asdict(s), present=[n for n in s.namespaces if n in live])
                        for s in states
                    ],
                    "refused": refused,
                    "unrecorded": [
                        {
                            "run_id": u.run_id,
                            "objects": u.objects,
                            "recorded_in": u.recorded_in,
                            "pids": list(u.pids),
                            "orphan": u.orphan,
                        }
                        for u in unrecorded
                    ],
                },
                indent=1,
            )
        )
        return EXIT_OK
    if not states:
        print(f"no emulations recorded in {args.state_dir}")
    for s in states:
        _print_state(s, live=live)
    for line in refused:
        print(line)
    if unrecorded:
        print(f"hc<id>-* objects that no state file in {args.state_dir} records:")
    for u in unrecorded:
        what = ", ".join(u.objects)
        if u.orphan:
            print(
                f"  hc{u.run_id}: orphaned (no state file anywhere known, no live process): "
                f"{what}; "
                f"'hetcomm emulate down --sweep --id hc{u.run_id}' removes it"
            )
        else:
            print(f"  hc{u.run_id}: {what}; {u.reason()}")
    return EXIT_OK


def _print_state(state, live: Optional[set]) -> None:
    present = ""
    if live is not None:
        n_live = sum(ns in live for ns in state.namespaces)
        present = f", {n_live}/{len(state.namespaces)} namespaces present"
    print(
        f"hc{state.run_id}  cluster {state.cluster_name}  {state.status}  mode {state.mode}  "
        f"scale {state.scale:g}  subnet {state.subnet}{present}"
    )
    print(
        f"  {'node':<12} {'namespace':<22} {'ranks':<10} {'nic':<6} {'address':<18} {'class':<13} "
        f"{'nominal':>9} {'shaped':>12}"
    )
    for n in state.nodes:
        for k, i in enumerate(n["ifaces"] or [{}]):
            head = (n["node"], n["ns"], ",".join(map(str, n["ranks"]))) if k == 0 else ("", "", "")
            print(
                f"  {head[0]:<12} {head[1]:<22} {head[2]:<10} {i.get('name', '-'):<6} "
                f"{i.get('address', '-'):<18} {i.get('class', '-'):<13} "
                f"{i.get('nominal_gbps', 0):>6g} Gb/s "
                f"{i.get('rate_bps', 0) / 1e6:>6g} Mbit/s"
            )
    for n in state.nodes:
        if n.get("cpus") is not None:
            print(
                f"  compute {n['node']:<12} x{n.get('compute_scale', 1):.3g}: {n['cpus']:.3g} CPUs "
                f"per rank (cgroups {state.prefix}{n['node']}-r<rank>)"
                + (f", {n['device_cpus']:.3g} for its training thread (<rank cgroup>/device)"
                   if n.get("device_cpus") is not None else "")
            )
    for q in state.qdiscs:
        if "cross-vendor" in q:
            print(f"  shaper {q}")
    for note in state.notes:
        print(f"  note: {note}")


def _run(args: argparse.Namespace) -> int:
    from hetcomm.emulate.fabric import bring_up, tear_down
    from hetcomm.emulate.ranks import run_ranks, tail
    from hetcomm.emulate.state import load_state, state_path

    cmd: List[str] = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError(
            "nothing to run: give the command after '--', e.g. "
            "'hetcomm emulate run --cluster C.yaml -- hetcomm bench alltoall'"
        )
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    owned = args.run_id is None
    if owned:
        cluster, plan = _plan_from_args(args)
        state = None
    else:
        path = state_path(args.state_dir, _norm_id(args.run_id))
        if not os.path.exists(path):
            raise UsageError(
                f"no emulation {args.run_id} in {args.state_dir}; see 'hetcomm emulate status'"
            )
        state = load_state(path)
    from hetcomm.cli._args import MAX_LOCAL_RANKS

    num_ranks = plan.num_ranks if owned else sum(len(n["ranks"]) for n in state.nodes)
    if num_ranks > MAX_LOCAL_RANKS:
        # Every rank is a local process (with torch, ~200 MB): refuse before anything is built.
        name = plan.cluster_name if owned else state.cluster_name
        raise UsageError(
            f"cluster '{name}' has {num_ranks} ranks; 'hetcomm emulate run' starts every rank as a "
            f"process on this machine and allows at most {MAX_LOCAL_RANKS}; use a smaller cluster "
            "(configs/clusters/mixed-mini.yaml) or 'hetcomm emulate up' to build and inspect it"
        )

    # SIGTERM/SIGHUP must tear down like Ctrl-C does; SIGKILL cannot, which is what `down` is for.
    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    failed_run = False
    try:
        if owned:
            state = bring_up(
                plan, state_dir=args.state_dir, cluster_path=cluster.path, progress=_log
            )
        _log(
            f"emulate: hc{state.run_id}: running {' '.join(cmd)!r} on "
            f"{sum(len(n['ranks']) for n in state.nodes)} ranks (rank 0's output follows; others "
            f"log to {os.path.join(args.state_dir, 'hc' + state.run_id)}/rank<N>.log)"
        )
        outcome = run_ranks(state, cmd, state_dir=args.state_dir, timeout_s=args.timeout)
        if outcome.exit_code != 0:
            failed_run = True
            _log(f"emulate: {outcome.message}")
            failed = outcome.first_failed_rank
            if failed is not None:
                text = tail(outcome.ranks[failed].log_path)
                if text:
                    _log(f"emulate: last lines of rank {failed}:\n" + text)
        else:
            _log(f"emulate: {outcome.message}")
        return outcome.exit_code
    finally:
        try:
            if owned and state is not None and not args.keep:
                # A failed run keeps its rank logs (not kernel state); `down` removes them.
                problems = tear_down(state, state_dir=args.state_dir, keep_logs=failed_run)
                if problems:
                    _log("emulate: tear-down left: " + "; ".join(problems))
            elif owned and state is not None:
                _log(
                    f"emulate: kept hc{state.run_id} up; remove it with 'hetcomm emulate down --id "
                    f"hc{state.run_id}'"
                )
        finally:
            for s, h in old.items():
                signal.signal(s, h)
