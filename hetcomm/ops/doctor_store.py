"""``hetcomm doctor``'s rule over torch's TCPStore lines in the job's logs.

=====================  =========  ===================================================================
code                   severity   fires when
=====================  =========  ===================================================================
``store-reverse-dns``  warning    a log shows c10d's ``The hostname of the client socket cannot be
                                  retrieved. err=-3``: a store connection's reverse lookup failed
                                  with ``EAI_AGAIN`` (the resolver timed out)
=====================  =========  ===================================================================

Why it matters: torch's TCPStore formats the address of every connection it makes or accepts
with ``getnameinfo`` without ``NI_NUMERICHOST`` (c10d's ``formatSockAddr``), a reverse DNS
lookup, on the client and on the server's one event-loop thread. An address without a hosts
entry (a one-machine job's ``::ffff:127.0.0.1``: the client prefers IPv6) goes to the
nameserver; one that drops a query holds that connection, and every other connection of the
store behind it, for the resolver's timeout (5 s by default). hetcomm opens store connections at
every rendezvous, heartbeat and membership change (``store.clone()``), so the stall lands there
(``benchmarks/README.md``, "Membership change").
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence

from hetcomm.topo.findings import FindingSpec
from hetcomm.topo.model import Finding

__all__ = ["STORE_CODES", "rule_store_reverse_dns"]

STORE_CODES: Dict[str, FindingSpec] = {
    s.code: s
    for s in (
        FindingSpec(
            "store-reverse-dns", "warning", "store connections wait on reverse DNS",
            "torch's TCPStore looks up the name of every connection's address; where the "
            "resolver has to ask a nameserver that drops the query, that connection and every "
            "other one of the store wait its timeout (5 s by default): rendezvous, heartbeats and "
            "membership changes stall.",
        ),
    )
}

#: c10d's warning when ``getnameinfo`` fails; -3 is ``EAI_AGAIN`` (a temporary resolver failure).
_HOSTNAME = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved\. err=(-?\d+)")


def rule_store_reverse_dns(logs: Sequence) -> List[Finding]:
    """``store-reverse-dns``: one finding per log (:class:`hetcomm.ops.doctor.LogFile`) whose
    lines carry c10d's failed lookup with ``err=-3``, at its first such line."""
    out = []
    for log in logs:
        hits = [i for i, line in enumerate(log.lines, 1) if (m := _HOSTNAME.search(line)) and m.group(1) == "-3"]
        if hits:
            out.append(Finding(
                "store-reverse-dns", STORE_CODES["store-reverse-dns"].severity,
                f"{log.path}:{hits[0]}",
                f"{len(hits)} store connection(s) logged a failed reverse lookup (err=-3, EAI_AGAIN): "
                "the resolver timed out on the connection's address, which the connection waited for.",
                "Give the store's address a hosts entry on every node (`::ffff:127.0.0.1 localhost` in "
                "/etc/hosts for a one-machine job, `::ffff:<ip> <name>` for a node's address) or a "
                "nameserver that answers; `RES_OPTIONS='timeout:1 attempts:1'` in the job's environment "
                "cuts each stall to 1 s.",
            ))
    return out
