"""Options of a hetcomm process group (``pg_options=`` of ``init_process_group``/``new_group``).

Every field can also come from an environment variable (launch-time facts for benchmarks and
torchrun scripts that cannot pass ``pg_options``); an explicit ``HetcommOptions`` field wins over
the environment. Values must agree on every rank of a group: chunk sizes, rails and plans decide
how many transfers each pair posts, and both ends must post the same ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Tuple

from hetcomm.errors import ConfigError

__all__ = ["HetcommOptions", "RAIL_NAMES", "PLAN_NAMES", "WIRE_DTYPES", "options_from_env", "wire_torch_dtype"]

RAIL_NAMES = ("shm", "gloo", "nccl", "hccl", "bridge")
PLAN_NAMES = ("direct", "auto", "flat", "hier", "multirail")
#: The one wire-dtype vocabulary of the backend and the MoE layer: ``exact`` keeps the tensor
#: dtype; ``cluster`` (alias ``auto``, the MoE layer's spelling) follows the cluster YAML's
#: ``wire_dtype`` policy (fp16 across vendors by default); the others force one wire dtype.
WIRE_DTYPES = ("exact", "cluster", "auto", "fp32", "fp16", "bf16")


def wire_torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of wire name ``fp32``/``fp16``/``bf16``."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]

_MiB = 1 << 20


@dataclass(frozen=True)
class HetcommOptions:
    """How a hetcomm group moves data.

    Attributes:
        rails: the rails this group may use, e.g. ``("shm", "gloo")`` (env ``HETCOMM_RAILS``);
            ``None`` = all that apply. A peer whose preferred rail is not allowed falls back to
            ``shm`` (same host and node) or ``gloo``; ``gloo`` is always allowed as the fallback.
        chunk_bytes: an ``all_to_all_single`` segment larger than this is cut into chunks of at
            most this many bytes (whole rows), so rails run concurrently and arrivals can be
            consumed early (env ``HETCOMM_CHUNK_BYTES``). Must agree on every rank.
        plan: ``direct`` (one step, every peer over its own rail) or a planner strategy
            (``auto``/``flat``/``hier``/``multirail``) executed by ``hetcomm.backends.executor``
            (env ``HETCOMM_PLAN``).
        check_splits: exchange split sizes, dtypes and row shapes across ranks before any byte
            moves, and raise ``ValueError`` everywhere on a mismatch (env ``HETCOMM_CHECK``,
            ``0`` turns it off). Off saves one round of tiny messages per all-to-all, at the price
            of a hang or a gloo abort on a caller bug.
        ring_bytes: capacity of each shared-memory ring (one per ordered same-node pair)
            (env ``HETCOMM_SHM_RING_BYTES``).
        wire_dtype: dtype floating-point tensors travel in over the ``bridge`` rail
            (env ``HETCOMM_WIRE_DTYPE``); see :data:`WIRE_DTYPES`. Default ``exact`` keeps
            torch.distributed's bit-exact contract; ``cluster`` is what the MoE layer asks for.
        cluster: path of the cluster YAML (env ``HETCOMM_CLUSTER``); ``None`` = placement by
            hostname.
        nic_ifnames: this rank's network interfaces, one per NIC port in rail order (env
            ``HETCOMM_IFNAMES``, else ``HETCOMM_EMULATE_IFNAMES``, which ``hetcomm emulate``
            sets). With a cluster YAML whose nodes all have ``R >= 2`` ports, the gloo rail then
            stripes every pair's transfers over ``R`` gloo groups, one bound to each port
            (:mod:`hetcomm.backends.rails.striped`). Set it on every rank or on none.
    """

    rails: Optional[Tuple[str, ...]] = None
    # 8 MiB: large enough that gloo's per-message cost (~50 us) stays < 5 % at loopback speed,
    # small enough that a 64 MiB segment still overlaps on several rails.
    chunk_bytes: int = 8 * _MiB
    plan: str = "direct"
    check_splits: bool = True
    # 4 MiB per ring: 12 rings for 4 ranks on one node = 48 MiB of /dev/shm, and large enough
    # that a writer rarely waits for its reader at the copy bandwidth of one core.
    ring_bytes: int = 4 * _MiB
    wire_dtype: str = "exact"
    cluster: Optional[str] = None
    nic_ifnames: Optional[Tuple[str, ...]] = None

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
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(
                f"unknown wire_dtype {self.wire_dtype!r}; choose from {', '.join(WIRE_DTYPES)}",
                key="wire_dtype",
            )


def _parse_size(text: str, key: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    try:
        return int(float(t[: len(t) - len(suffix)]) * units[suffix])
    except ValueError:
        raise ConfigError(f"expected a size like 4M or 65536, got {text!r}", key=key) from None


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
    env = os.environ if environ is None else environ
    base = base if base is not None else HetcommOptions()
    default = HetcommOptions()
    changes = {}

    def unset(name: str) -> bool:
        return getattr(base, name) == getattr(default, name)

    try:
        if unset("rails") and env.get("HETCOMM_RAILS"):
            changes["rails"] = tuple(r.strip() for r in env["HETCOMM_RAILS"].split(",") if r.strip())
        if unset("chunk_bytes") and env.get("HETCOMM_CHUNK_BYTES"):
            changes["chunk_bytes"] = _parse_size(env["HETCOMM_CHUNK_BYTES"], "HETCOMM_CHUNK_BYTES")
        if unset("plan") and env.get("HETCOMM_PLAN"):
            changes["plan"] = env["HETCOMM_PLAN"].strip()
        if unset("check_splits") and env.get("HETCOMM_CHECK"):
            changes["check_splits"] = env["HETCOMM_CHECK"].strip().lower() not in ("0", "false", "no", "off")
        if unset("ring_bytes") and env.get("HETCOMM_SHM_RING_BYTES"):
            changes["ring_bytes"] = _parse_size(env["HETCOMM_SHM_RING_BYTES"], "HETCOMM_SHM_RING_BYTES")
        if unset("wire_dtype") and env.get("HETCOMM_WIRE_DTYPE"):
            changes["wire_dtype"] = env["HETCOMM_WIRE_DTYPE"].strip()
        if unset("cluster") and env.get("HETCOMM_CLUSTER"):
            changes["cluster"] = env["HETCOMM_CLUSTER"]
        ifnames = env.get("HETCOMM_IFNAMES") or env.get("HETCOMM_EMULATE_IFNAMES")
        if unset("nic_ifnames") and ifnames:
            changes["nic_ifnames"] = tuple(i.strip() for i in ifnames.split(",") if i.strip())
        return replace(base, **changes) if changes else base
    except ConfigError as e:
        if e.key and not e.key.startswith("HETCOMM_"):
            raise ConfigError(
                str(e).split(": ", 1)[-1], key="HETCOMM_" + {"rails": "RAILS", "plan": "PLAN", "wire_dtype": "WIRE_DTYPE"}.get(e.key, e.key.upper())
            ) from None
        raise


