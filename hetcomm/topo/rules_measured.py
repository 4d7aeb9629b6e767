"""The audit's rules that compare what was measured and installed with what was expected.

(Filled in below: ``bandwidth-shortfall`` and the known-bad version rules.)
"""

from __future__ import annotations

from typing import List

from hetcomm.topo.model import Finding
from hetcomm.topo.rules import RuleContext

__all__ = ["measured_rules"]


def measured_rules(ctx: RuleContext) -> List[Finding]:
    """Findings of the measurement and version rules."""
    return []
