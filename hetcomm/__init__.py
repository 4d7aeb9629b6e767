"""hetcomm: communication middleware for Mixture-of-Experts training on heterogeneous clusters.

``import hetcomm`` registers the ``"hetcomm"`` torch.distributed backend, so that
``dist.init_process_group("hetcomm")`` works; scripts that never import hetcomm get the same
through torch's ``torch.backends`` entry point (:func:`_autoload`).
"""

from __future__ import annotations

from hetcomm._version import __version__

from hetcomm.errors import (  # noqa: E402
    CollectiveError,
    ConfigError,
    HetcommError,
    PeerTimeout,
    TopologyParseError,
    UsageError,
)

__all__ = [
    "__version__",
    "HetcommError",
    "ConfigError",
    "TopologyParseError",
    "CollectiveError",
    "PeerTimeout",
    "UsageError",
    "stats",
    "reset_stats",
    "Communicator",
    "communicator",
    "TokenSwitch",
]


def __getattr__(name: str):
    # Lazy: ``import hetcomm`` stays cheap (no executor, rails or CUDA imports) until a
    # communicator is asked for.
    if name == "Communicator":
        from hetcomm.backends.communicator import Communicator

        return Communicator
    if name == "TokenSwitch":
        # torch's expert-parallel TokenSwitch contract over the same token engine.
        from hetcomm.backends.tokens.switch import TokenSwitch

        return TokenSwitch
    raise AttributeError(f"module 'hetcomm' has no attribute {name!r}")


def communicator(group=None):
    """The :class:`hetcomm.Communicator` of ``group`` (default: the default group), built on
    first use (collectively: every rank of the group calls it the first time)."""
    from hetcomm.backends.communicator import communicator as _communicator

    return _communicator(group)


def stats():
    """Per-rail counters of this process (see ``hetcomm.backends.stats``)."""
    from hetcomm.backends.stats import stats as _stats

    return _stats()


def reset_stats() -> None:
    """Zero every per-rail counter of this process."""
    from hetcomm.backends.stats import reset_stats as _reset

    _reset()


def _autoload() -> None:
    """Entry point of group ``torch.backends``: torch calls it at the end of ``import torch``.

    Must never raise: an exception here would break ``import torch`` for every program.
    """
    try:
        from hetcomm.backends.registry import register

        register()
    except Exception:  # pragma: no cover - defensive, see docstring
        pass


from hetcomm.backends.registry import register as _register  # noqa: E402

_register()
