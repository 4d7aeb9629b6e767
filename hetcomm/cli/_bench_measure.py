"""``hetcomm bench`` measurement: one rank's run (init, warm-up, timed loop, check, rail statistics) and the merge of all ranks' results on rank 0."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from hetcomm import settings
from hetcomm.cli._bench_config import _TORCH_DTYPE, BenchConfig, bus_factor, message_sizes
from hetcomm.units import format_bytes
from hetcomm.cli._bench_workload import _fill_input, _make_ops, count_wrong


def machine_description() -> Dict[str, Any]:
    """Host name, CPU count, CPU model (from /proc/cpuinfo) and the current UTC date."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "num_cpus": os.cpu_count() or 0,
        "cpu_model": model,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }



# -- one rank ---------------------------------------------------------------------------------


def _progress(message: str) -> None:
    print(f"hetcomm bench: {message}", file=sys.stderr, flush=True)


def _device_info(rank: int, local_rank: int, cluster_path: Optional[str]) -> Dict[str, Any]:
    """What this rank stands for: from the cluster YAML when there is one."""
    info: Dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": local_rank,
        "torch_device": "cpu",
        "model": None,
        "vendor": "cpu",
        "node": None,
        "label_only": False,
    }
    if cluster_path:
        from hetcomm.topo.cluster import load_cluster

        cluster = load_cluster(cluster_path)
        r = cluster.rank(rank)
        info.update(
            device=r.local_rank,
            model=r.model,
            vendor=r.vendor,
            node=r.node.name,
            device_name=r.device_name,
            # Tensors live in host memory in this tool, so a GPU/NPU in the YAML is a label.
            label_only=r.vendor in ("nvidia", "ascend"),
        )
    return info


def _rail_stats() -> Optional[Dict[str, Any]]:
    """This process's per-rail counters from ``hetcomm.stats()``, JSON-friendly, or None."""
    try:
        import hetcomm

        raw = hetcomm.stats()
    except Exception:  # the backend's stats module may not exist (gloo runs, older trees)
        return None
    return _jsonable(raw)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    if hasattr(value, "_asdict"):
        return _jsonable(value._asdict())
    return str(value)



def _init_kwargs(config: BenchConfig) -> Dict[str, Any]:
    """Extra ``init_process_group`` arguments: the hetcomm options object forcing rails/plan."""
    if config.backend != "hetcomm" or (config.rails is None and config.plan is None):
        return {}
    from hetcomm.backends.options import HetcommOptions

    fields: Dict[str, Any] = {}
    if config.rails is not None:
        fields["rails"] = tuple(config.rails)
    if config.plan is not None:
        fields["plan"] = config.plan
    # Explicit options win over HETCOMM_* variables inherited from the environment.
    return {"pg_options": HetcommOptions(**fields)}


def run_rank(
    config: BenchConfig,
    rank: int,
    world_size: int,
    local_rank: int = 0,
    store=None,
    progress: bool = True,
) -> Optional[Dict[str, Any]]:
    """Run the whole benchmark as one rank of a ``world_size`` group.

    Initializes the default process group (``env://`` unless ``store`` is given), measures every
    size, gathers every rank's timings and checks with ``all_gather_object`` and destroys the
    group.

    Args:
        config: the run; identical on every rank.
        rank: this process's global rank.
        world_size: number of ranks.
        local_rank: device index on this host (printed in the ``# Rank`` lines).
        store: a ``torch.distributed.Store`` to rendezvous through, or None for ``env://``.
        progress: rank 0 reports each finished size on stderr.

    Returns:
        On rank 0, the result document (see :func:`format_table`); on other ranks, the same
        document too (every rank needs the totals to choose its exit code).
    """
    import datetime as _dt

    import torch
    import torch.distributed as dist

    if config.backend == "hetcomm":
        import hetcomm  # noqa: F401  (registers the backend)

    timeout = _dt.timedelta(seconds=config.timeout_s)
    kwargs = _init_kwargs(config)
    if store is not None:
        dist.init_process_group(
            config.backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )
    else:
        dist.init_process_group(
            config.backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **kwargs,
        )
    try:
        return _measure(config, rank, world_size, local_rank, progress, torch, dist)
    finally:
        dist.destroy_process_group()


def _measure(config, rank, world_size, local_rank, progress, torch, dist) -> Dict[str, Any]:
    dtype = getattr(torch, _TORCH_DTYPE[config.datatype])
    oop, inplace = _make_ops(config, dist, world_size)
    sizes = message_sizes(config, world_size)
    if config.backend == "hetcomm":
        _reset_rail_stats()
    t_start = time.perf_counter()
    last_report = t_start
    local_rows = []
    for index, (size_bytes, count) in enumerate(sizes):
        src = torch.empty(count, dtype=dtype)
        dst = torch.empty(count, dtype=dtype)
        scratch = torch.empty(count, dtype=dtype)
        row: Dict[str, Any] = {"size": size_bytes, "count": count}
        for name, fn in (("out_of_place", oop), ("in_place", inplace)):
            _fill_input(config, src, rank, world_size, count)
            for _ in range(config.warmup_iters):
                fn(src, dst, scratch)
            # Start every rank's clock together; the barrier itself is outside the timed region.
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(config.iters):
                fn(src, dst, scratch)
            seconds = (time.perf_counter() - t0) / config.iters
            wrong = None
            if config.check:
                # One extra call on fresh data; timed loops above may have overwritten src.
                _fill_input(config, src, rank, world_size, count)
                fn(src, dst, scratch)
                wrong = count_wrong(
                    config, rank, world_size, dst if name == "out_of_place" else src
                )
            row[name] = {"seconds": seconds, "wrong": wrong}
        local_rows.append(row)
        del src, dst, scratch
        now = time.perf_counter()
        if progress and rank == 0 and (now - last_report > 1.0 or index == len(sizes) - 1):
            last_report = now
            _progress(
                f"{config.collective} {format_bytes(size_bytes)} done ({index + 1}/{len(sizes)} "
                f"sizes, {now - t_start:.1f} s)"
            )

    mine = {
        "info": _device_info(rank, local_rank, config.cluster or settings.CLUSTER.get()),
        "rows": local_rows,
        "rails": _rail_stats() if config.backend == "hetcomm" else None,
    }
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return _merge(config, world_size, gathered)


def _reset_rail_stats() -> None:
    try:
        import hetcomm

        hetcomm.reset_stats()
    except Exception:  # no stats module yet: the rail counters are simply not reported
        pass


def _merge(
    config: BenchConfig, world_size: int, per_rank: Sequence[Dict[str, Any]]
) -> Dict[str, Any]:
    """Combine every rank's measurements into the result document."""
    import torch

    factor = bus_factor(config.collective, world_size)
    rows = []
    busbws = []
    total_wrong = 0
    for i, base in enumerate(per_rank[0]["rows"]):
        row: Dict[str, Any] = {
            "size": base["size"],
            "count": base["count"],
            "type": config.datatype,
            "redop": config.redop,
            "root": -1,
        }
        for name in ("out_of_place", "in_place"):
            per_rank_seconds = [r["rows"][i][name]["seconds"] for r in per_rank]
            seconds = max(per_rank_seconds)
            algbw = base["size"] / seconds / 1e9 if seconds > 0 else 0.0
            busbw = algbw * factor
            wrongs = [r["rows"][i][name]["wrong"] for r in per_rank]
            wrong = None if any(w is None for w in wrongs) else int(sum(wrongs))
            total_wrong += wrong or 0
            busbws.append(busbw)
            row[name] = {
                "time_us": seconds * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
                "wrong": wrong,
                "time_us_per_rank": [s * 1e6 for s in per_rank_seconds],
            }
        rows.append(row)
    ranks = [r["info"] for r in per_rank]
    from hetcomm._version import __version__

    return {
        "tool": "hetcomm bench",
        "version": __version__,
        "torch": torch.__version__,
        "collective": config.collective,
        "test": f"{config.collective}_perf",
        "num_ranks": world_size,
        "config": json.loads(config.to_json()),
        "machine": machine_description(),
        "ranks": ranks,
        "labels_only": any(r.get("label_only") for r in ranks),
        "rails": [r["rails"] for r in per_rank] if config.backend == "hetcomm" else None,
        "rows": rows,
        "out_of_bounds": total_wrong,
        "avg_busbw_gbps": (sum(busbws) / len(busbws)) if busbws else 0.0,
        "time_definition": "max over ranks of each rank's mean seconds per iteration",
    }
