"""Options of a hetcomm process group (``pg_options=`` of ``init_process_group``/``new_group``).

Every field can also come from an environment variable (launch-time facts for benchmarks and
torchrun scripts that cannot pass ``pg_options``); an explicit ``HetcommOptions`` field wins over
the environment. Values must agree on every rank of a group: chunk sizes, rails and plans decide
how many transfers each pair posts, and both ends must post the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, FrozenSet, Mapping, Optional, Sequence, Tuple, Union

from hetcomm import settings
from hetcomm.errors import ConfigError, UsageError
from hetcomm.settings import PLAN_NAMES, RAIL_NAMES
from hetcomm.wire_dtypes import BACKEND_SPELLINGS, parse_wire_dtype, wire_torch_dtype

if TYPE_CHECKING:
    from hetcomm.topo.cluster import Cluster

__all__ = ["HetcommOptions", "RAIL_NAMES", "PLAN_NAMES", "WIRE_DTYPES", "options_from_env", "wire_torch_dtype"]

#: The vocabularies live on the lowest floor (:mod:`hetcomm.settings`, :mod:`hetcomm.wire_dtypes`),
#: where the environment variables are parsed; re-exported here for source compatibility.
WIRE_DTYPES = BACKEND_SPELLINGS

_MiB = 1 << 20


class _Unset:
    """Default of every :class:`HetcommOptions` argument: "not passed" (tells explicit from default)."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


@dataclass(frozen=True, init=False)
class HetcommOptions:
    """How a hetcomm group moves data.

    Attributes:
        rails: the rails this group may use, e.g. ``("shm", "gloo")`` (env ``HETCOMM_RAILS``);
            ``None`` = all that apply. A peer whose preferred rail is not allowed falls back to
            ``shm`` (same host and node) or ``gloo``; ``gloo`` is always allowed as the fallback.
        chunk_bytes: an ``all_to_all_single`` segment larger than this is cut into chunks of at
            most this many bytes (whole rows), so rails run concurrently and arrivals can be
            consumed early (env ``HETCOMM_CHUNK_BYTES``). Must agree on every rank.
        plan: ``adaptive`` (default: the planner decides per shape class of the split matrix
            and a ``hier``/``multirail`` plan runs where the cost model predicts >= 10 % over
            the direct path, ``hetcomm.backends.planpick``), ``direct`` (one step, every peer
            over its own rail) or a pinned planner strategy (``auto``/``flat``/``hier``/
            ``multirail``) executed by ``hetcomm.backends.executor`` (env ``HETCOMM_PLAN``).
        check_splits: exchange split sizes, dtypes and row shapes across ranks before any byte
            moves, and raise ``ValueError`` everywhere on a mismatch (env ``HETCOMM_CHECK``,
            ``0`` turns it off). Off saves one round of tiny messages per all-to-all, at the price
            of a hang or a gloo abort on a caller bug.
        ring_bytes: capacity of each shared-memory ring (one per ordered same-node pair)
            (env ``HETCOMM_SHM_RING_BYTES``).
        wire_dtype: dtype floating-point tensors travel in over the ``bridge`` rail
            (env ``HETCOMM_WIRE_DTYPE``); see :data:`WIRE_DTYPES`. Default ``exact`` keeps
            torch.distributed's bit-exact contract; ``cluster`` is what the MoE layer asks for.
        cluster: path of the cluster YAML, or a loaded :class:`~hetcomm.topo.cluster.Cluster`
            (``hetcomm train`` parses the file once per rank and passes the object) (env
            ``HETCOMM_CLUSTER``); ``None`` = placement by hostname (or detection). An explicit
            ``cluster=None`` keeps a stray ``HETCOMM_CLUSTER`` out.
        nic_ifnames: this rank's network interfaces, one per NIC port in rail order (env
            ``HETCOMM_IFNAMES``, else ``HETCOMM_EMULATE_IFNAMES``, which ``hetcomm emulate``
            sets). With a cluster YAML whose nodes all have ``R >= 2`` ports, the gloo rail then
            stripes every pair's transfers over ``R`` gloo groups, one bound to each port
            (:mod:`hetcomm.backends.rails.striped`). Set it on every rank or on none.

    Fields passed to the constructor are *explicit* (:attr:`explicit`) and always win over the
    environment, even when the value equals the default (``HetcommOptions(check_splits=True)``
    under ``HETCOMM_CHECK=0`` keeps the check on). ``dataclasses.replace`` passes every field,
    so its result counts every field as explicit; use :meth:`with_changes` to keep the rest
    open to the environment.
    """

    rails: Optional[Tuple[str, ...]] = None
    # 8 MiB: large enough that gloo's per-message cost (~50 us) stays < 5 % at loopback speed,
    # small enough that a 64 MiB segment still overlaps on several rails.
    chunk_bytes: int = 8 * _MiB
    plan: str = "adaptive"
    check_splits: bool = True
    # 4 MiB per ring: 12 rings for 4 ranks on one node = 48 MiB of /dev/shm, and large enough
    # that a writer rarely waits for its reader at the copy bandwidth of one core.
    ring_bytes: int = 4 * _MiB
    wire_dtype: str = "exact"
    cluster: "Optional[Union[str, Cluster]]" = None
    nic_ifnames: Optional[Tuple[str, ...]] = None

    # Which fields the caller passed, and where each effective value came from (set by
    # options_from_env): excluded from ==, repr and hash.
    _explicit: FrozenSet[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _sources: Tuple[Tuple[str, str], ...] = field(default=(), init=False, repr=False, compare=False)

    def __init__(
        self,
        rails: Optional[Sequence[str]] = _UNSET,
        chunk_bytes: int = _UNSET,
        plan: str = _UNSET,
        check_splits: bool = _UNSET,
        ring_bytes: int = _UNSET,
        wire_dtype: str = _UNSET,
        cluster: "Optional[Union[str, Cluster]]" = _UNSET,
        nic_ifnames: Optional[Sequence[str]] = _UNSET,
    ) -> None:
        given = {
            "rails": rails, "chunk_bytes": chunk_bytes, "plan": plan, "check_splits": check_splits,
            "ring_bytes": ring_bytes, "wire_dtype": wire_dtype, "cluster": cluster, "nic_ifnames": nic_ifnames,
        }
        explicit = []
        for f in fields(self):
            if not f.init:
                continue
            value = given[f.name]
            if value is _UNSET:
                value = f.default
            else:
                explicit.append(f.name)
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "_explicit", frozenset(explicit))
        object.__setattr__(self, "_sources", tuple((n, "pg_options") for n in explicit))
        self.__post_init__()

    @property
    def explicit(self) -> FrozenSet[str]:
        """Names of the fields the caller passed (they win over ``HETCOMM_*`` variables)."""
        return self._explicit

    def source(self, name: str) -> str:
        """Where field ``name``'s value came from: ``pg_options`` (explicit), the environment
        variable's name, or ``default``."""
        return dict(self._sources).get(name, "default")

    def with_changes(self, **changes: Any) -> "HetcommOptions":
        """A copy with ``changes`` made explicit; the other fields keep their explicit status."""
        keep = {n: getattr(self, n) for n in self._explicit}
        keep.update(changes)
        return HetcommOptions(**keep)

    def __post_init__(self) -> None:
        if self.rails is not None:
            rails = tuple(self.rails)
            unknown = [r for r in rails if r not in RAIL_NAMES]
            if unknown or not rails:
                raise ConfigError(
                    f"unknown rail(s) {unknown or rails!r}; choose from {', '.join(RAIL_NAMES)} "
                    f"(e.g. HETCOMM_RAILS=shm,gloo)",
                    key="rails",
                )
            object.__setattr__(self, "rails", rails)
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be a positive int, got {self.chunk_bytes!r}", key="chunk_bytes")
        if self.plan not in PLAN_NAMES:
            raise ConfigError(f"unknown plan {self.plan!r}; choose from {', '.join(PLAN_NAMES)}", key="plan")
        if isinstance(self.ring_bytes, bool) or not isinstance(self.ring_bytes, int) or self.ring_bytes < 4096:
            raise ConfigError(f"ring_bytes must be an int >= 4096, got {self.ring_bytes!r}", key="ring_bytes")
        parse_wire_dtype(self.wire_dtype, allowed=BACKEND_SPELLINGS, key="wire_dtype")


def options_from_env(
    base: Optional[HetcommOptions] = None, environ: Optional[Mapping[str, str]] = None
) -> HetcommOptions:
    """Fill the fields ``base`` leaves at their defaults from ``HETCOMM_*`` variables.

    Args:
        base: options passed by the caller (``pg_options``), or None.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: naming the variable whose value is invalid.
    """
    env = environ  # None: os.environ (hetcomm.settings reads it)
    base = base if base is not None else HetcommOptions()
    values = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
    sources = {n: "pg_options" for n in base.explicit}

    def unset(name: str) -> bool:
        return name not in base.explicit

    def take(name: str, var: str, value: Any) -> None:
        values[name] = value
        sources[name] = var

    try:
        # Each variable is parsed by its declaration (hetcomm.settings): a bad value raises a
        # SettingError naming the variable, the value and what is allowed.
        for name, setting in _SETTING_OF.items():
            if unset(name) and setting.is_set(env):
                take(name, setting.name, setting.get(env))
        ifnames = settings.IFNAMES if settings.IFNAMES.is_set(env) else settings.EMULATE_IFNAMES
        if unset("nic_ifnames") and ifnames.is_set(env):
            take("nic_ifnames", ifnames.name, ifnames.get(env))
        out = HetcommOptions(**{n: values[n] for n in sources})
    except ConfigError as e:
        if e.key and not e.key.startswith("HETCOMM_"):
            var = _ENV_OF.get(e.key)
            if var is not None and sources.get(e.key) == var:
                raise ConfigError(f"{e.detail}", key=var) from None
        raise
    object.__setattr__(out, "_explicit", base.explicit)
    object.__setattr__(out, "_sources", tuple(sorted(sources.items())))
    return out


#: The declared variable of each field (nic_ifnames: HETCOMM_IFNAMES, else HETCOMM_EMULATE_IFNAMES).
_SETTING_OF = {
    "rails": settings.RAILS,
    "chunk_bytes": settings.CHUNK_BYTES,
    "plan": settings.PLAN,
    "check_splits": settings.CHECK,
    "ring_bytes": settings.SHM_RING_BYTES,
    "wire_dtype": settings.WIRE_DTYPE,
    "cluster": settings.CLUSTER,
}

#: The environment variable of each field.
_ENV_OF = {
    "rails": "HETCOMM_RAILS",
    "chunk_bytes": "HETCOMM_CHUNK_BYTES",
    "plan": "HETCOMM_PLAN",
    "check_splits": "HETCOMM_CHECK",
    "ring_bytes": "HETCOMM_SHM_RING_BYTES",
    "wire_dtype": "HETCOMM_WIRE_DTYPE",
    "cluster": "HETCOMM_CLUSTER",
    "nic_ifnames": "HETCOMM_IFNAMES",
}
