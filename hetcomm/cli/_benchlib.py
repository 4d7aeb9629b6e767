"""Measurement code behind ``hetcomm bench``: sizes, data patterns, timing loop, table, JSON.

The metrics follow nccl-tests (``doc/PERFORMANCE.md``); ``docs/BENCH.md`` defines every printed
number. Notation used below::

    n      number of ranks in the group
    size   bytes per rank: what one rank sends (alltoall) or reduces (allreduce)
    count  elements per rank, ``size // itemsize`` (alltoall: rounded down to a multiple of n)
    time   seconds per iteration: each rank times ``iters`` back-to-back calls and divides by
           ``iters``; the table shows the maximum of that mean over the ranks
    algbw  size / time
    busbw  algbw * (n-1)/n (alltoall) or algbw * 2(n-1)/n (allreduce)

A run is one process per rank. ``run_rank`` is the body of a rank, whether the rank was started
by ``hetcomm bench --nprocs N`` (see ``hetcomm.cli.bench``) or by torchrun; rank 0 returns the
merged result, which :func:`format_table` renders as the nccl-tests table.
"""

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

from hetcomm import launcher as _launcher
from hetcomm import settings
from hetcomm.errors import UsageError
from hetcomm.units import format_bytes, parse_size

__all__ = [
    "COLLECTIVES",
    "DATATYPES",
    "KNOWN_RAILS",
    "REDOPS",
    "BenchConfig",
    "parse_bytes",
    "format_bytes",
    "message_sizes",
    "bus_factor",
    "machine_description",
    "run_rank",
    "format_table",
    "alltoall_input",
    "alltoall_expected",
    "allreduce_input",
    "allreduce_expected",
    "count_wrong",
    "launch_ranks",
    "run_local",
    "LaunchResult",
    "RankFailure",
]

COLLECTIVES = ("alltoall", "allreduce")

# nccl-tests type names first (the table prints them), then accepted aliases.
DATATYPES: Dict[str, str] = {
    "int8": "int8",
    "char": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
    "half": "half",
    "float16": "half",
    "fp16": "half",
    "float": "float",
    "float32": "float",
    "fp32": "float",
    "double": "double",
    "float64": "double",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_TORCH_DTYPE = {
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bfloat16": "bfloat16",
}
_ITEMSIZE = {
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "half": 2,
    "float": 4,
    "double": 8,
    "bfloat16": 2,
}

# AVG and PRODUCT are left out on purpose: gloo has no AVG, and an exact PRODUCT check would
# overflow every small integer type after a few ranks.
REDOPS = ("sum", "max", "min")

# Rails the backend issue defines; the backend itself decides which exist on this machine.
KNOWN_RAILS = settings.RAIL_NAMES  # the one vocabulary (hetcomm.settings)

def parse_bytes(text: str, flag: str = "size") -> int:
    """A byte count as nccl-tests reads ``-b/-e``: ``8``, ``1K``, ``1.5M``, ``1G`` (powers of 2).

    The one size parser of every command (:func:`hetcomm.units.parse_size`); ``flag`` is named
    in the error.

    Raises:
        UsageError: not a whole, positive number of bytes up to 1 TiB.
    """
    return parse_size(text, what=flag)


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs; identical on every rank.

    Attributes:
        collective: ``alltoall`` or ``allreduce``.
        minbytes / maxbytes: first and last message size, bytes per rank.
        stepfactor: multiply the size by this between rows (> 1), or 1 to add ``stepbytes``.
        stepbytes: bytes added between rows when ``stepfactor`` is 1.
        iters: timed iterations per size and variant.
        warmup_iters: untimed iterations before the timed ones, per size and variant.
        check: verify the results of one extra call per size and variant (``#wrong``).
        datatype: nccl-tests type name (a key of the table in :data:`DATATYPES` values).
        redop: ``none`` for alltoall, else one of :data:`REDOPS`.
        backend: torch.distributed backend name (``hetcomm`` or ``gloo``).
        rails: rails forced through ``HETCOMM_RAILS`` (None: the backend chooses per peer).
        cluster: cluster YAML path the ranks were given (``HETCOMM_CLUSTER``), or None.
        plan: value passed to the backend's plan option, or None.
        timeout_s: collective and store timeout, seconds.
    """

    collective: str
    minbytes: int = 32 << 20
    maxbytes: int = 32 << 20
    stepfactor: int = 2
    stepbytes: int = 1 << 20
    iters: int = 20
    warmup_iters: int = 1
    check: bool = True
    datatype: str = "float"
    redop: str = "none"
    backend: str = "hetcomm"
    rails: Optional[Tuple[str, ...]] = None
    cluster: Optional[str] = None
    plan: Optional[str] = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # The CLI validates with flag names first; this guards programmatic use.
        if self.collective not in COLLECTIVES:
            raise UsageError(
                f"collective {self.collective!r} is not one of {', '.join(COLLECTIVES)}"
            )
        if self.datatype not in _ITEMSIZE:
            raise UsageError(f"datatype {self.datatype!r} is not one of {', '.join(_ITEMSIZE)}")
        if self.minbytes > self.maxbytes:
            raise UsageError(f"minbytes {self.minbytes} > maxbytes {self.maxbytes}")
        if self.iters < 1 or self.warmup_iters < 0:
            raise UsageError("iters must be >= 1 and warmup_iters >= 0")
        if self.stepfactor < 1 or (self.stepfactor == 1 and self.stepbytes < 1):
            raise UsageError("stepfactor must be >= 1, and stepbytes >= 1 when stepfactor is 1")

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`datatype`."""
        return _ITEMSIZE[self.datatype]

    def to_json(self) -> str:
        """This config as a JSON string (how the parent hands it to its ranks)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        if data.get("rails") is not None:
            data["rails"] = tuple(data["rails"])
        return cls(**data)


def bus_factor(collective: str, num_ranks: int) -> float:
    """busbw / algbw: (n-1)/n for alltoall, 2(n-1)/n for allreduce (nccl-tests' factors)."""
    if num_ranks < 1:
        raise UsageError(f"a group needs at least one rank, got {num_ranks}")
    base = (num_ranks - 1) / num_ranks
    return 2.0 * base if collective == "allreduce" else base


def message_sizes(config: BenchConfig, num_ranks: int) -> List[Tuple[int, int]]:
    """The ``(size_bytes, count)`` rows of a run, in order.

    Sizes follow nccl-tests' loop (``size *= stepfactor`` or ``size += stepbytes`` while
    ``size <= maxbytes``). ``count = size // itemsize``; for alltoall it is rounded down to a
    multiple of ``num_ranks`` (every peer gets the same number of elements), and the printed
    size is ``count * itemsize``. Sizes that round to zero elements, or to the same count as the
    previous row, are dropped.
    """
    rows: List[Tuple[int, int]] = []
    size = config.minbytes
    while size <= config.maxbytes:
        count = size // config.itemsize
        if config.collective == "alltoall":
            count = (count // num_ranks) * num_ranks
        if count > 0 and (not rows or rows[-1][1] != count):
            rows.append((count * config.itemsize, count))
        if config.stepfactor > 1:
            if size == 0:
                size = 1
            size *= config.stepfactor
        else:
            size += config.stepbytes
    return rows


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


# -- data patterns ----------------------------------------------------------------------------
# Small integers (< 97 for alltoall, <= 2*n for allreduce) are exact in every supported dtype,
# including int8 and bfloat16, so the check is exact equality, never a tolerance.


def alltoall_input(rank: int, num_ranks: int, count: int, dtype):
    """The send buffer of ``rank``: block ``p`` (for peer p) holds ``(7*rank + 13*p + i) % 97``.

    Returns:
        ``[count]`` tensor of ``dtype``; ``count`` is a multiple of ``num_ranks``.
    """
    import torch

    block = count // num_ranks
    i = torch.arange(block, dtype=torch.int64)
    peers = torch.arange(num_ranks, dtype=torch.int64).unsqueeze(1)
    return ((7 * rank + 13 * peers + i) % 97).reshape(-1).to(dtype)


def alltoall_expected(rank: int, num_ranks: int, count: int, dtype):
    """What ``rank`` must receive: block ``p`` is peer p's block for ``rank``.

    Returns:
        ``[count]`` tensor of ``dtype``.
    """
    import torch

    block = count // num_ranks
    i = torch.arange(block, dtype=torch.int64)
    sources = torch.arange(num_ranks, dtype=torch.int64).unsqueeze(1)
    return ((7 * sources + 13 * rank + i) % 97).reshape(-1).to(dtype)


def allreduce_input(rank: int, count: int, dtype):
    """``rank``'s contribution: element i is ``(rank + i) % 3``.

    Returns:
        ``[count]`` tensor of ``dtype``.
    """
    import torch

    return ((rank + torch.arange(count, dtype=torch.int64)) % 3).to(dtype)


def allreduce_expected(num_ranks: int, count: int, redop: str, dtype):
    """The reduction of every rank's :func:`allreduce_input` under ``redop``.

    The value of element i depends only on ``i % 3``, so three reductions over the ranks give the
    whole expected tensor.

    Returns:
        ``[count]`` tensor of ``dtype``.
    """
    import torch

    reduce: Callable[[List[int]], int] = {"sum": sum, "max": max, "min": min}[redop]
    table = torch.tensor(
        [reduce([(r + k) % 3 for r in range(num_ranks)]) for k in range(3)], dtype=torch.int64
    )
    return table[torch.arange(count, dtype=torch.int64) % 3].to(dtype)


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


def _make_ops(config: BenchConfig, dist, num_ranks: int):
    """The out-of-place and in-place calls, each ``fn(src, dst, scratch) -> None``.

    torch has no out-of-place all_reduce and gives no meaning to an all_to_all_single whose
    output aliases its input (gloo silently corrupts the result: rank 1 and 2 of 4 received
    wrong data in a test on torch 2.13). So each collective has one native form and one form
    that adds a local copy, and the copy is inside the timed region:

    * alltoall   out-of-place: ``all_to_all_single(dst, src)``              (native)
    * alltoall   in-place:     ``all_to_all_single(scratch, src); src.copy_(scratch)``
    * allreduce  out-of-place: ``dst.copy_(src); all_reduce(dst)``
    * allreduce  in-place:     ``all_reduce(src)``                          (native)
    """
    if config.collective == "alltoall":

        def oop(src, dst, scratch):
            dist.all_to_all_single(dst, src)

        def inplace(src, dst, scratch):
            dist.all_to_all_single(scratch, src)
            src.copy_(scratch)

    else:
        op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
            config.redop
        ]

        def oop(src, dst, scratch):
            dst.copy_(src)
            dist.all_reduce(dst, op=op)

        def inplace(src, dst, scratch):
            dist.all_reduce(src, op=op)

    return oop, inplace


def _fill_input(config: BenchConfig, buf, rank: int, num_ranks: int, count: int) -> None:
    if config.collective == "alltoall":
        buf.copy_(alltoall_input(rank, num_ranks, count, buf.dtype))
    else:
        buf.copy_(allreduce_input(rank, count, buf.dtype))


def _expected(config: BenchConfig, rank: int, num_ranks: int, count: int, dtype):
    if config.collective == "alltoall":
        return alltoall_expected(rank, num_ranks, count, dtype)
    return allreduce_expected(num_ranks, count, config.redop, dtype)


def count_wrong(config: BenchConfig, rank: int, num_ranks: int, result) -> int:
    """Elements of ``result`` that differ from what ``rank`` must hold after the collective.

    Args:
        config: the run (collective, redop).
        rank: the rank that holds ``result``.
        num_ranks: group size.
        result: ``[count]`` tensor after one call on :func:`alltoall_input` /
            :func:`allreduce_input` data.

    Returns:
        The number of wrong elements (0 when the collective delivered the known pattern).
    """
    expected = _expected(config, rank, num_ranks, result.numel(), result.dtype)
    return int((result != expected).sum().item())


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


# -- the table --------------------------------------------------------------------------------

# nccl-tests' header, verbatim (tests/fixtures/nccltests_alltoall_perf_b300_1node_2node.txt);
# every value of a row is right-aligned to the end of its header word.
_HEADER_1 = (
    "#                                                              out-of-place"
    "                       in-place"
)
_HEADER_2 = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong"
)
_HEADER_3 = (
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
    "            (us)  (GB/s)  (GB/s)"
)
_COLUMN_ENDS = [m.end() for m in re.finditer(r"\S+", _HEADER_2)][1:]  # skip the leading '#'


def _time_str(time_us: float) -> str:
    # nccl-tests' precision rule: fewer decimals as the number grows.
    if time_us >= 10000.0:
        return f"{time_us:.0f}"
    if time_us >= 100.0:
        return f"{time_us:.1f}"
    return f"{time_us:.2f}"


def _row_line(values: Sequence[str]) -> str:
    line = ""
    for value, end in zip(values, _COLUMN_ENDS):
        start = max(end - len(value), len(line) + 1)
        line += " " * (start - len(line)) + value
    return line


def _rank_line(info: Dict[str, Any], cpu_model: str) -> str:
    """nccl-tests' ``#  Rank`` line. The bracket (a PCI bus id in nccl-tests) says where the
    tensors really are and, with a cluster YAML, that the device kind is a label; the model
    follows the bracket, as in nccl-tests."""
    where = info["torch_device"] + (", label" if info.get("label_only") else "")
    model = info.get("model") or cpu_model
    return (
        f"#  Rank {info['rank']:2d} Group  0 Pid {info['pid']:6d} on {info['host']:>10s} "
        f"device {info['device']:2d} [{where}] {model}"
    )


def _label_lines(result: Dict[str, Any]) -> List[str]:
    """Where each rank stands, and the statement that GPU/NPU kinds are labels."""
    ranks = [i for i in result["ranks"] if i.get("model")]
    if not ranks:
        return []
    stands = ", ".join(
        f"rank {i['rank']} = {i.get('device_name', '')} {i['model']} on {i['node']}".replace(
            "  ", " "
        )
        for i in ranks
    )
    lines = [f"# Cluster placement: {stands}"]
    if result.get("labels_only"):
        cfg = result["config"]
        cluster = os.path.basename(cfg.get("cluster") or "") or "the cluster YAML"
        lines.append(
            f"# Device kinds are labels: each rank is a CPU process standing for the GPU/NPU "
            f"named in {cluster}; tensors stay in host memory, and the transports between the "
            f"processes (shared memory, TCP) are real."
        )
    return lines


def format_table(result: Dict[str, Any]) -> str:
    """Render a result document (from :func:`run_rank`) as nccl-tests prints its table.

    Lines: ``#`` metadata (version, parameters, one ``#  Rank`` line per rank), the three header
    lines, one row per size with out-of-place and in-place ``time algbw busbw #wrong``, then
    ``# Out of bounds values`` and ``# Avg bus bandwidth``.
    """
    cfg = result["config"]
    machine = result["machine"]
    rails = ",".join(cfg["rails"]) if cfg.get("rails") else "chosen per peer"
    step = f"{cfg['stepfactor']}(factor)" if cfg["stepfactor"] > 1 else f"{cfg['stepbytes']}(bytes)"
    lines = [
        f"# hetcomm bench version {result['version']} torch {result['torch']}",
        f"# Collective test starting: {result['test']}",
        f"# nThread 1 nGpus 1 minBytes {cfg['minbytes']} maxBytes {cfg['maxbytes']} step: {step} "
        f"warmup iters: {cfg['warmup_iters']} iters: {cfg['iters']} agg iters: 1 "
        f"validation: {int(cfg['check'])} graph: 0",
        f"# backend: {cfg['backend']}"
        + (f"  rails: {rails}" if cfg["backend"] == "hetcomm" else "")
        + (f"  plan: {cfg['plan']}" if cfg.get("plan") else "")
        + f"  ranks: {result['num_ranks']}  datatype: {cfg['datatype']}  redop: {cfg['redop']}",
        f"# machine: {machine['host']}, {machine['num_cpus']} CPUs, {machine['cpu_model']}; "
        f"date: {machine['date']}",
        "# time: max over ranks of each rank's mean time per iteration",
        "#",
        "# Using devices",
    ]
    lines += [_rank_line(info, machine["cpu_model"]) for info in result["ranks"]]
    lines += _label_lines(result)
    rail_line = _rail_summary(result.get("rails"))
    if rail_line:
        lines.append(rail_line)
    lines += ["#", _HEADER_1, _HEADER_2, _HEADER_3]
    for row in result["rows"]:
        values = [str(row["size"]), str(row["count"]), row["type"], row["redop"], str(row["root"])]
        for name in ("out_of_place", "in_place"):
            block = row[name]
            values += [
                _time_str(block["time_us"]),
                f"{block['algbw_gbps']:.2f}",
                f"{block['busbw_gbps']:.2f}",
                "N/A" if block["wrong"] is None else str(block["wrong"]),
            ]
        lines.append(_row_line(values))
    status = "OK" if result["out_of_bounds"] == 0 else "FAILED"
    lines += [
        f"# Out of bounds values : {result['out_of_bounds']} {status}",
        f"# Avg bus bandwidth    : {_avg_str(result['avg_busbw_gbps'])}",
        "#",
        f"# Collective test concluded: {result['test']}",
    ]
    return "\n".join(lines) + "\n"


def _avg_str(value: float) -> str:
    # nccl-tests prints %g-like output ("359.21", "102.495"); keep 6 significant digits.
    return f"{value:.6g}"


def _rail_summary(rails: Optional[List[Any]]) -> str:
    """``# Rail bytes sent (all ranks): shm 3.0 MiB, gloo 0 B`` from hetcomm.stats() counters."""
    if not rails:
        return ""
    totals: Dict[str, float] = {}
    for per_rank in rails:
        if not isinstance(per_rank, dict):
            return ""
        for rail, counters in per_rank.items():
            sent = _sent_bytes(counters)
            if sent is None:
                continue
            totals[rail] = totals.get(rail, 0.0) + sent
    if not totals:
        return ""
    parts = ", ".join(f"{rail} {format_bytes(v)}" for rail, v in sorted(totals.items()))
    return f"# Rail bytes sent (all ranks, whole run incl. warmup and checks): {parts}"


def _sent_bytes(counters: Any) -> Optional[float]:
    if isinstance(counters, dict):
        for key in ("bytes_sent", "sent_bytes", "tx_bytes"):
            if isinstance(counters.get(key), (int, float)) and not isinstance(
                counters.get(key), bool
            ):
                return float(counters[key])
    return None


# -- launching local ranks ----------------------------------------------------------------------
# Ranks are started by the one launcher (hetcomm.launcher, start="exec"): separate Python processes
# like torchrun's, not forks, so each one imports torch itself and owns its threads. The launcher
# hosts the TCPStore (no free-port race); every rank connects to it as a client. This layer keeps
# bench's view of a launch: rank 0's result, the failures root cause first, exit warnings.

is_timeout = _launcher.is_timeout


@dataclass(frozen=True)
class RankFailure:
    """One rank that did not finish.

    Attributes:
        rank: its global rank.
        exit_code: process exit status (negative: killed by that signal).
        error_type: class name of the exception it raised, or None when it died without one.
        message: the exception message or a description of the death.
        is_timeout: the failure is a timeout (exit code 3 for the command).
        killed_by_launcher: it was still running after another rank failed and was stopped.
    """

    rank: int
    exit_code: int
    error_type: Optional[str]
    message: str
    is_timeout: bool
    killed_by_launcher: bool = False


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch_ranks`: rank 0's return value or the failures.

    Attributes:
        result: rank 0's return value (None when a rank failed).
        failures: ranks that did not finish, the first failure first.
        exit_warnings: ranks that finished their work (result reported, group destroyed) and then
            died while the interpreter shut down, e.g. a C++ thread aborting in a destructor. The
            result stands; the crash is reported, never hidden.
    """

    result: Any
    failures: Tuple[RankFailure, ...]
    exit_warnings: Tuple[RankFailure, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures


def launch_ranks(
    target: str,
    payload: str,
    num_ranks: int,
    *,
    timeout_s: float,
    env: Optional[Dict[str, str]] = None,
    grace_s: float = 10.0,
) -> LaunchResult:
    """Run ``target(payload, rank, world_size, store)`` in ``num_ranks`` fresh processes.

    Args:
        target: ``"module:function"``; the function must be importable in the child (set
            ``PYTHONPATH`` through ``env`` for modules outside the package). Rank 0's return
            value becomes :attr:`LaunchResult.result`.
        payload: a string handed to every rank unchanged (a JSON config).
        num_ranks: number of processes; ranks 0..num_ranks-1 with ``LOCAL_RANK`` = rank.
        timeout_s: store timeout; a rank that cannot rendezvous fails after this long.
        env: extra environment for the ranks (e.g. ``HETCOMM_CLUSTER``).
        grace_s: after the first rank fails, how long the others get to fail on their own (they
            usually see the broken connection at once) before they are stopped.

    Returns:
        The result of rank 0, or the failures, the first failure first.

    Raises:
        SystemExit: SIGTERM while the ranks ran (exit status 143, after they were stopped and the
            ``hetcomm-bench-*`` scratch directory was removed).
    """
    outcome = _launcher.launch(
        _bench_child,
        num_ranks,
        args=(target, payload, timeout_s),
        start="exec",
        env=env,
        store=True,
        store_timeout_s=timeout_s,
        grace_s=grace_s,
        kill_grace_s=5.0,
        clean_shm=True,
        name="bench",
    )
    failures, exit_warnings = [], []
    ended = list(outcome.end_order)
    for r in ended + [r for r in range(num_ranks) if r not in ended]:
        rank = outcome.ranks[r]
        if rank.exit_warning:
            exit_warnings.append(_failure(rank))
        elif not rank.ok:
            failures.append(_failure(rank))
    # Root causes first: a rank's own error beats "connection closed by peer" on the others,
    # and those beat ranks the launcher had to stop.
    failures.sort(key=lambda f: (f.killed_by_launcher, _is_secondary(f.message)))
    result = outcome.ranks[0].result if not failures else None
    return LaunchResult(result=result, failures=tuple(failures), exit_warnings=tuple(exit_warnings))


def _is_secondary(message: str) -> bool:
    lowered = message.lower()
    return any(
        s in lowered for s in ("connection closed by peer", "connection reset", "broken pipe")
    )


def _failure(rank: "_launcher.RankOutcome") -> RankFailure:
    return RankFailure(
        rank.rank,
        rank.exitcode if rank.exitcode is not None else -9,
        rank.error_type,
        (rank.error or "") if rank.error_type is not None else rank.how_it_ended(),
        is_timeout=rank.timeout_error,
        killed_by_launcher=rank.stopped is not None,
    )


def _bench_child(target: str, payload: str, timeout_s: float) -> Any:
    """The launcher's target in every bench rank: connect to the launcher's store, run
    ``target(payload, rank, world_size, store)``; rank 0's return value is the result."""
    import importlib

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        import torch.distributed as dist

        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size + 1,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # A prefix per launch keeps the keys of this run apart from anything else on the store.
        store = dist.PrefixStore("hetcomm-bench/", store)
        result = func(payload, rank, world_size, store)
    except BaseException:
        if settings.BENCH_TRACEBACK.get():
            import traceback

            traceback.print_exc()
        raise
    return result if rank == 0 else None


def bench_rank_entry(payload: str, rank: int, world_size: int, store) -> Optional[Dict[str, Any]]:
    """:func:`launch_ranks` target of ``hetcomm bench``: one rank of :func:`run_rank`."""
    config = BenchConfig.from_json(payload)
    return run_rank(config, rank, world_size, local_rank=rank, store=store)


def run_local(
    config: BenchConfig, num_ranks: int, env: Optional[Dict[str, str]] = None
) -> Dict[str, Any]:
    """Start ``num_ranks`` local ranks, run the benchmark, return the result document.

    The programmatic form of ``hetcomm bench ... --nprocs N`` (``hetcomm audit --bench`` can
    use it): the same JSON document ``--json`` prints; :func:`format_table` renders it.

    Raises:
        PeerTimeout: the first failing rank timed out.
        CollectiveError: a rank failed otherwise (its rank and error in the message).
    """
    from hetcomm.errors import CollectiveError, PeerTimeout

    extra = dict(env or {})
    if config.cluster:
        extra.setdefault("HETCOMM_CLUSTER", config.cluster)
    outcome = launch_ranks(
        "hetcomm.cli._benchlib:bench_rank_entry",
        config.to_json(),
        num_ranks,
        timeout_s=config.timeout_s,
        env=extra,
    )
    if not outcome.ok:
        first = outcome.failures[0]
        others = "; ".join(f"rank {f.rank}: {f.message}" for f in outcome.failures[1:])
        cls = PeerTimeout if first.is_timeout else CollectiveError
        raise cls(
            f"{first.error_type or 'died'}: {first.message}"
            + (f" (then {others})" if others else ""),
            op=f"bench {config.collective}",
            rank=first.rank,
            rail=None,
        )
    return outcome.result
