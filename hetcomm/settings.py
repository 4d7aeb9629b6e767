"""The one registry of hetcomm's environment variables.

Every ``HETCOMM_*`` variable is declared here once: its name, type, default, one line of doc,
the modules that read it and the ones that set it for a child process. Code reads a variable only
through its declaration (``settings.CLUSTER.get()``, typed per kind), never through
``os.environ`` (``tests/test_architecture.py`` fails on such a read anywhere else), so a bad value
always ends in the same :class:`~hetcomm.errors.SettingError`, naming the variable, the value and
what is allowed, before anything else runs.

Precedence, everywhere: an explicit argument (a function parameter, a CLI flag, a field passed in
``pg_options=HetcommOptions(...)``, a config-file key) beats the environment, which beats the
default. The environment is for launch-time facts that scripts under ``torchrun`` cannot pass any
other way; values that must agree across ranks are compared by
:mod:`hetcomm.backends.agreement` whatever their source.

``hetcomm settings --markdown`` prints the table in ``docs/ARCHITECTURE.md``
("Environment variables"); ``tests/test_settings.py`` checks that the page equals the registry.

This module is on the lowest floor: it imports :mod:`hetcomm.errors`, :mod:`hetcomm.units` and
:mod:`hetcomm.wire_dtypes` only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Generic, List, Mapping, Optional, Sequence, Tuple, TypeVar

from hetcomm.errors import SettingError
from hetcomm.wire_dtypes import BACKEND_SPELLINGS

__all__ = [
    "Setting",
    "StrSetting",
    "BoolSetting",
    "IntSetting",
    "FloatSetting",
    "SizeSetting",
    "ChoiceSetting",
    "ListSetting",
    "REGISTRY",
    "RAIL_NAMES",
    "PLAN_NAMES",
    "SAME_HOST_WAYS",
    "setting",
    "unknown_names",
    "markdown_table",
]

T = TypeVar("T")

#: The rails a group may use (``HETCOMM_RAILS``, ``HetcommOptions.rails``).
RAIL_NAMES: Tuple[str, ...] = ("shm", "gloo", "nccl", "hccl", "bridge")
#: ``adaptive`` (the planner decides per shape class), ``direct`` or a pinned planner strategy
#: (``HETCOMM_PLAN``, ``HetcommOptions.plan``).
PLAN_NAMES: Tuple[str, ...] = ("adaptive", "direct", "auto", "flat", "hier", "multirail")
#: The ways same-host pairs can move bytes (``HETCOMM_SAME_HOST_RAIL``; rail calibration).
SAME_HOST_WAYS: Tuple[str, ...] = ("shm", "gloo", "cma")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_Environ = Optional[Mapping[str, str]]


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One ``HETCOMM_*`` variable.

    Attributes:
        name: the variable, ``HETCOMM_...``.
        default: the value when the variable is unset or empty (None: "not given").
        doc: one line: what it does.
        readers: modules that read it (through this declaration), dotted.
        set_by: modules that set it for child processes (``hetcomm launch``, ``hetcomm emulate``).
    """

    name: str
    default: Optional[T]
    doc: str
    readers: Tuple[str, ...]
    set_by: Tuple[str, ...] = ()

    #: The type column of the docs table.
    kind = "string"

    def raw(self, environ: _Environ = None) -> Optional[str]:
        """The value as set (stripped), or None when unset or empty."""
        env = os.environ if environ is None else environ
        text = env.get(self.name)
        if text is None or not text.strip():
            return None
        return text.strip()

    def is_set(self, environ: _Environ = None) -> bool:
        """True when the variable is set to a non-empty value."""
        return self.raw(environ) is not None

    def get(self, environ: _Environ = None) -> Optional[T]:
        """The parsed value, or :attr:`default` when unset.

        Args:
            environ: the environment to read (default ``os.environ``; a child's env dict works too).

        Raises:
            SettingError: the value cannot be parsed; names the variable, the value and the
                allowed values.
        """
        text = self.raw(environ)
        return self.default if text is None else self.parse(text)

    def parse(self, text: str) -> T:
        """``text`` as this setting's type (raises :class:`SettingError`)."""
        return text  # type: ignore[return-value]

    def allowed(self) -> str:
        """What the variable accepts, in words (the docs table and every error)."""
        return "any non-empty string"

    def _error(self, text: str, reason: str = "") -> SettingError:
        return SettingError(self.name, text, self.allowed(), reason=reason)


@dataclass(frozen=True)
class StrSetting(Setting[str]):
    """A free-form string or path."""

    #: ``path`` for a file or directory, ``string`` otherwise (the docs' type column).
    form: str = "string"

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.form

    def allowed(self) -> str:
        return "a path" if self.form == "path" else "any non-empty string"


@dataclass(frozen=True)
class BoolSetting(Setting[bool]):
    """``1/true/yes/on`` or ``0/false/no/off`` (any case)."""

    kind = "bool"

    def parse(self, text: str) -> bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise self._error(text)

    def allowed(self) -> str:
        return "/".join(_TRUE) + " or " + "/".join(_FALSE)


@dataclass(frozen=True)
class IntSetting(Setting[int]):
    """A whole number, at least :attr:`minimum`."""

    minimum: int = 0
    kind = "int"

    def parse(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise self._error(text, "not a whole number") from None
        if value < self.minimum:
            raise self._error(text, f"below {self.minimum}")
        return value

    def allowed(self) -> str:
        return f"a whole number >= {self.minimum}"


@dataclass(frozen=True)
class FloatSetting(Setting[float]):
    """A finite number, at least :attr:`minimum` and at most :attr:`maximum` when one is given
    (a finite 1e308 still overflows ``time.sleep`` or a ``timedelta``)."""

    minimum: float = 0.0
    maximum: Optional[float] = None
    kind = "float"

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise self._error(text, "not a number") from None
        if value != value or value in (float("inf"), float("-inf")) or value < self.minimum:
            raise self._error(text, "out of range")
        if self.maximum is not None and value > self.maximum:
            raise self._error(text, f"above {self.maximum:g}")
        return value

    def allowed(self) -> str:
        if self.maximum is not None:
            return f"a number from {self.minimum:g} to {self.maximum:g}"
        return f"a number >= {self.minimum:g}"


@dataclass(frozen=True)
class SizeSetting(Setting[int]):
    """A byte count in hetcomm's one size syntax (:func:`hetcomm.units.parse_size`)."""

    minimum: int = 1
    kind = "size"

    def parse(self, text: str) -> int:
        from hetcomm.errors import UsageError
        from hetcomm.units import parse_size

        try:
            return parse_size(text, what=self.name, minimum=self.minimum)
        except UsageError as e:
            raise self._error(text, str(e).split("; ", 1)[-1]) from None

    def allowed(self) -> str:
        return f"a byte count >= {self.minimum} like 4096, 64K, 8M or 1.5G (binary units)"


@dataclass(frozen=True)
class ChoiceSetting(Setting[str]):
    """One of :attr:`choices` (compared case-insensitively when :attr:`fold_case`)."""

    choices: Tuple[str, ...] = ()
    fold_case: bool = False
    kind = "choice"

    def parse(self, text: str) -> str:
        value = text.lower() if self.fold_case else text
        if value not in self.choices:
            raise self._error(text)
        return value

    def allowed(self) -> str:
        return ", ".join(self.choices)


@dataclass(frozen=True)
class ListSetting(Setting[Tuple[str, ...]]):
    """Comma-separated names, each one of :attr:`choices` when choices are given."""

    choices: Tuple[str, ...] = ()
    kind = "list"

    def parse(self, text: str) -> Tuple[str, ...]:
        items = tuple(i.strip() for i in text.split(",") if i.strip())
        bad = [i for i in items if self.choices and i not in self.choices]
        if not items or bad:
            raise self._error(text, f"unknown {', '.join(map(repr, bad))}" if bad else "empty list")
        return items

    def allowed(self) -> str:
        if self.choices:
            return f"comma-separated names from {', '.join(self.choices)}"
        return "comma-separated names"


_B = "hetcomm.backends"

# -- cluster and topology ---------------------------------------------------------------------
CLUSTER = StrSetting(
    "HETCOMM_CLUSTER", None,
    "cluster YAML every rank places itself by (a --cluster flag, a config key or HetcommOptions.cluster wins)",
    readers=("hetcomm.topo.cluster", f"{_B}.options", "hetcomm.cli.bench", "hetcomm.cli._bench_measure",
             "hetcomm.cli.discover", "hetcomm.cli.launch", "hetcomm.ops.worker"),
    set_by=("hetcomm.ops.worker", "hetcomm.emulate.ranks"),
    form="path",
)
DETECT = BoolSetting(
    "HETCOMM_DETECT", True,
    "without a cluster file, detect the cluster by probing every host (0 = place by hostname only)",
    readers=(f"{_B}.rank_placement",),
)
PROBE_DIR = StrSetting(
    "HETCOMM_PROBE_DIR", None,
    "directory of captured tool outputs the probe reads instead of this host ({rank} = the rank)",
    readers=("hetcomm.topo.discover",),
    form="path",
)
MAX_INPUT_BYTES = SizeSetting(
    "HETCOMM_MAX_INPUT_BYTES", 16 << 20,
    "cap on one captured tool output or YAML file read by the parsers (before and after gzip)",
    readers=("hetcomm._input",),
)

# -- the backend (HetcommOptions fields: pg_options wins) -------------------------------------
RAILS = ListSetting(
    "HETCOMM_RAILS", None,
    "rails a group may use (HetcommOptions.rails); unset = every rail that applies",
    readers=(f"{_B}.options",),
    choices=RAIL_NAMES,
)
CHUNK_BYTES = SizeSetting(
    "HETCOMM_CHUNK_BYTES", 8 << 20,
    "largest piece of one all-to-all segment on a rail (HetcommOptions.chunk_bytes); agreed across ranks",
    readers=(f"{_B}.options",),
)
SHM_RING_BYTES = SizeSetting(
    "HETCOMM_SHM_RING_BYTES", 4 << 20,
    "capacity of each shared-memory ring (HetcommOptions.ring_bytes); agreed across ranks",
    readers=(f"{_B}.options",),
    minimum=4096,
)
CHECK = BoolSetting(
    "HETCOMM_CHECK", True,
    "compare split sizes, dtypes and shapes across ranks before bytes move (HetcommOptions.check_splits)",
    readers=(f"{_B}.options",),
)
PLAN = ChoiceSetting(
    "HETCOMM_PLAN", "adaptive",
    "all-to-all path: adaptive (a staged plan where the cost model predicts >= 10 % gain, else direct), "
    "direct, or a pinned planner strategy (HetcommOptions.plan); agreed across ranks",
    readers=(f"{_B}.options",),
    choices=PLAN_NAMES,
)
PLAN_STAGE_US = FloatSetting(
    "HETCOMM_PLAN_STAGE_US", 500.0,
    "adaptive plans: fixed cost charged per extra stage of a staged plan (the executor's stage "
    "barrier, not in the cost model), microseconds; agreed across ranks",
    readers=(f"{_B}.planpick",),
)
WIRE_DTYPE = ChoiceSetting(
    "HETCOMM_WIRE_DTYPE", "exact",
    "dtype floating-point tensors cross the bridge rail in (HetcommOptions.wire_dtype; hetcomm.wire_dtypes)",
    readers=(f"{_B}.options",),
    choices=BACKEND_SPELLINGS,
)
IFNAMES = ListSetting(
    "HETCOMM_IFNAMES", None,
    "this rank's network interfaces, one per NIC port in rail order (HetcommOptions.nic_ifnames)",
    readers=(f"{_B}.options",),
)
SAME_HOST_RAIL = ChoiceSetting(
    "HETCOMM_SAME_HOST_RAIL", None,
    "pin how same-host pairs move bytes instead of calibrating (read by the calibration leader)",
    readers=(f"{_B}.calibrate",),
    choices=SAME_HOST_WAYS,
)
RECALIBRATE = BoolSetting(
    "HETCOMM_RECALIBRATE", False,
    "ignore the calibration cache and measure the same-host rails again",
    readers=(f"{_B}.calibrate",),
)
CACHE_DIR = StrSetting(
    "HETCOMM_CACHE_DIR", None,
    "directory of the rail-calibration cache (default ~/.cache/hetcomm)",
    readers=(f"{_B}.calibrate",),
    form="path",
)
LOG = ChoiceSetting(
    "HETCOMM_LOG", None,
    "log level of the hetcomm.backends logger, printed to stderr (unset = no handler)",
    readers=(f"{_B}.process_group",),
    choices=("debug", "info", "warning", "error", "critical"),
    fold_case=True,
)

# -- hetcomm launch -> its torchrun workers ----------------------------------------------------
LAUNCH_DIR = StrSetting(
    "HETCOMM_LAUNCH_DIR", None,
    "work directory of this hetcomm launch (the worker records a finished job's exit code there)",
    readers=("hetcomm.ops.worker", "hetcomm.ops.ops_records", "hetcomm.ops.membership"),
    set_by=("hetcomm.cli.launch",),
    form="path",
)
NODE = StrSetting(
    "HETCOMM_NODE", None,
    "the cluster node this hetcomm launch --node stands for (the worker publishes it)",
    readers=("hetcomm.ops.worker",),
    set_by=("hetcomm.cli.launch",),
)
JOB_ID = StrSetting(
    "HETCOMM_JOB_ID", None,
    "the job's id: names its in-memory snapshot segments (hetcomm launch: the rendezvous id; unset: torchrun's run id)",
    readers=("hetcomm.ops.snapshot",),
    set_by=("hetcomm.cli.launch", "hetcomm.train.loop"),
)
LAUNCH_NONCE = StrSetting(
    "HETCOMM_LAUNCH_NONCE", None,
    "this launch's nonce (one per hetcomm launch, kept across torchrun restarts): which launch a snapshot belongs to",
    readers=("hetcomm.ops.job_identity",),
    set_by=("hetcomm.cli.launch",),
)
JOIN = BoolSetting(
    "HETCOMM_JOIN", False,
    "set by hetcomm train --grow-back on the process it starts in a killed rank's slot (RANK, WORLD_SIZE: the "
    "slot and the original world): it joins the survivors through dist._reconfigure instead of starting the job",
    readers=("hetcomm.train.growback",),
    set_by=("hetcomm.train.local_ranks",),
)
LAUNCH_OWNER = StrSetting(
    "HETCOMM_LAUNCH_OWNER", None,
    "boot id, pid and start time of the hetcomm launch process: while it lives its job's state is not stale",
    readers=("hetcomm.ops.job_identity",),
    set_by=("hetcomm.cli.launch",),
)
SNAPSHOT_ROOT = StrSetting(
    "HETCOMM_SNAPSHOT_ROOT", "/dev/shm",
    "node-local shared memory where training snapshots live (<root>/hetcomm-<uid>-<job id>/)",
    readers=("hetcomm.ops.snapshot",),
    form="path",
)
GROUP_SIZE = IntSetting(
    "HETCOMM_GROUP_SIZE", 0,
    "grouped start: ranks per start group (0 = all at once)",
    readers=("hetcomm.ops.worker",),
    set_by=("hetcomm.cli.launch",),
)
GROUP_DELAY = FloatSetting(
    "HETCOMM_GROUP_DELAY", 0.0,
    "grouped start: seconds between two start groups",
    readers=("hetcomm.ops.worker",),
    set_by=("hetcomm.cli.launch",),
    maximum=3600.0,  # hetcomm launch --group-delay's bound: an hour between waves
)
BENCH_TRACEBACK = BoolSetting(
    "HETCOMM_BENCH_TRACEBACK", False,
    "hetcomm bench ranks print their full traceback on a failure",
    readers=("hetcomm.cli._benchlib",),
)

# -- hetcomm emulate -> the ranks of an emulated node -------------------------------------------
EMULATE = StrSetting(
    "HETCOMM_EMULATE", None,
    "run id (hc<id>) of the emulated cluster this process belongs to (found by the orphan sweep)",
    readers=("hetcomm.emulate.fabric", "hetcomm.emulate.orphans"),
    set_by=("hetcomm.emulate.ranks",),
)
EMULATE_SCALE = FloatSetting(
    "HETCOMM_EMULATE_SCALE", None,
    "rate scale of the emulated links (rates on the wire are gbps * scale; the plan cost model scales by it)",
    readers=(f"{_B}.planpick", "hetcomm.ops.health", "benchmarks", "tests"),
    set_by=("hetcomm.emulate.ranks",),
)
EMULATE_NODE = StrSetting(
    "HETCOMM_EMULATE_NODE", None,
    "name of the emulated node this rank runs on (a100-0)",
    readers=("benchmarks", "tests"),
    set_by=("hetcomm.emulate.ranks",),
)
EMULATE_IFNAMES = ListSetting(
    "HETCOMM_EMULATE_IFNAMES", None,
    "every emulated NIC of the node, rail order; nic_ifnames when HETCOMM_IFNAMES is unset",
    readers=(f"{_B}.options",),
    set_by=("hetcomm.emulate.ranks",),
)
EMULATE_ADDRS = ListSetting(
    "HETCOMM_EMULATE_ADDRS", None,
    "IPv4 addresses of the emulated NICs, same order",
    readers=("tests",),
    set_by=("hetcomm.emulate.ranks",),
)
EMULATE_COMPUTE = StrSetting(
    "HETCOMM_EMULATE_COMPUTE", None,
    "with hetcomm emulate --compute: the node's relative speed and the rank's CPUs (speed/cpus)",
    readers=("tests", "hetcomm.ops.probe", "hetcomm.cli.launch"),
    set_by=("hetcomm.emulate.ranks",),
)


def _collect() -> Dict[str, Setting]:
    out: Dict[str, Setting] = {}
    for value in list(globals().values()):
        if isinstance(value, Setting):
            assert value.name not in out, f"{value.name} declared twice"
            out[value.name] = value
    return dict(sorted(out.items()))


#: Every declared variable, by name.
REGISTRY: Mapping[str, Setting] = _collect()


def setting(name: str) -> Setting:
    """The declaration of variable ``name``.

    Raises:
        KeyError: ``name`` is not declared (declare it here first).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared hetcomm setting; declare it in hetcomm/settings.py") from None


def unknown_names(environ: _Environ = None) -> List[Tuple[str, Optional[str]]]:
    """``HETCOMM_*`` variables set in ``environ`` that nothing declares, each with the closest
    declared name (a typo such as ``HETCOMM_CLUSTERS``), or None."""
    import difflib

    env = os.environ if environ is None else environ
    out = []
    for name in sorted(n for n in env if n.startswith("HETCOMM_") and n not in REGISTRY):
        close = difflib.get_close_matches(name, list(REGISTRY), n=1)
        out.append((name, close[0] if close else None))
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def markdown_table(settings: Sequence[Setting] = ()) -> str:
    """The docs table of ``settings`` (default: the whole registry), one row per variable."""
    rows = list(settings) or list(REGISTRY.values())
    lines = [
        "| variable | type | default | what it does | allowed | read by | set by |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        default = s.default
        if isinstance(s, SizeSetting) and default is not None:
            from hetcomm.units import format_bytes

            default = format_bytes(default)
        lines.append(
            f"| `{s.name}` | {s.kind} | {_cell(default)} | {s.doc} | {s.allowed()} | "
            f"{', '.join(s.readers)} | {', '.join(s.set_by) or '-'} |"
        )
    return "\n".join(lines) + "\n"
