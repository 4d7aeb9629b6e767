"""An emulated heterogeneous cluster on one machine: network namespaces as nodes, veth pairs as
NICs, the kernel's token-bucket shaper (``tc tbf``) as link speed.

Modules, one job each:

- :mod:`hetcomm.emulate.spec`    cluster YAML -> :class:`NetPlan` (names, addresses, rates); pure.
- :mod:`hetcomm.emulate.kernel`  ``ip``/``tc`` invocations and prerequisite checks.
- :mod:`hetcomm.emulate.state`   the state file written before anything is created.
- :mod:`hetcomm.emulate.fabric`  bring a plan up, tear a state down (also after a crash).
- :mod:`hetcomm.emulate.ranks`  one process per rank inside its node's namespace.

The command line is ``hetcomm emulate up|down|run|status`` (``hetcomm.cli.emulate``); see
``docs/EMULATE.md``.
"""

from hetcomm.emulate.spec import EmulationSettings, NetPlan, plan_network, settings_from_cluster

__all__ = ["EmulationSettings", "NetPlan", "plan_network", "settings_from_cluster"]
