"""Launcher and log prefixes, stripped before any format is recognised.

Tool output rarely arrives bare: a launcher or a log collector puts its own tag in front of
every line. Each family below is removed from the lines that carry it when it is on at least
half of the non-blank lines (so a stray ``12: `` inside a tool's own output is left alone), and
families may stack (a Kubernetes timestamp in front of a Slurm task tag). Line numbers are kept:
only the start of each line changes, so errors still name the line of the original file.

=================  =========================================  ==================================
family             looks like                                 written by
=================  =========================================  ==================================
``rfc3339``        ``2024-05-01T12:00:00.123456789Z ``        ``kubectl logs --timestamps``,
                   (also ``2024-05-01 12:00:00,123 ``)        Docker/journald ``-o short-iso`` exports
``openmpi-tag``    ``[1,7]<stdout>:``                         OpenMPI ``mpirun --tag-output``
``slurm-task``     ``  7: ``                                  Slurm ``srun -l`` / ``--label``
``torchrun-rank``  ``[rank7]:`` / ``[default7]:``             torchrun (``--tee`` / local-rank
                                                              log prefix), torch's ``[rank7]:``
``host-tag``       ``node-3: `` / ``10.0.0.5: ``              pdsh, DeepSpeed's launcher,
                                                              ``mpirun`` wrappers
=================  =========================================  ==================================

Hand-written because no library strips these tags: each launcher documents its own format and
nothing else reads them back.
"""

from __future__ import annotations

import re
from typing import List, Pattern, Tuple

from hetcomm.topo.parse._text import is_source_header

__all__ = ["PREFIX_FAMILIES", "strip_prefixes"]

_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})? ?"
)
_OPENMPI = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:\s?")
_SLURM = re.compile(r"^\s{0,4}\d{1,5}: ")
_TORCHRUN = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
# A host name with a digit or a dash in it (node-3, worker-0, 10.0.0.5, gpu12), then ": ".
# Plain words ("Rate: 200", "Firmware: 28.39") are tool fields, never a host tag.
_HOST = re.compile(r"^(?=[A-Za-z0-9.-]*[0-9-])[A-Za-z0-9][A-Za-z0-9.-]{0,62}: ")

#: ``(family, pattern)`` in the order they are tried (outermost first).
PREFIX_FAMILIES: Tuple[Tuple[str, Pattern[str]], ...] = (
    ("rfc3339", _RFC3339),
    ("openmpi-tag", _OPENMPI),
    ("slurm-task", _SLURM),
    ("torchrun-rank", _TORCHRUN),
    ("host-tag", _HOST),
)

_MIN_SHARE = 0.5
_MAX_LAYERS = 4


def strip_prefixes(text: str) -> Tuple[str, List[str]]:
    """``text`` without launcher/log prefixes, and the families removed (outermost first).

    A provenance header (``# source: ...``) on line 1 is kept as it is. The line count and each
    line's position are preserved.
    """
    lines = text.split("\n")
    head = 1 if lines and is_source_header(lines[0]) else 0
    found: List[str] = []
    for _ in range(_MAX_LAYERS):
        body = [i for i in range(head, len(lines)) if lines[i].strip()]
        if not body:
            break
        stripped = False
        for family, pattern in PREFIX_FAMILIES:
            hits = [i for i in body if pattern.match(lines[i])]
            if len(hits) < 2 or len(hits) < _MIN_SHARE * len(body):
                continue
            if family == "host-tag" and len({pattern.match(lines[i]).group(0) for i in hits}) > 256:
                continue  # every line a different "word: ": a key/value listing, not a tag
            for i in hits:
                lines[i] = pattern.sub("", lines[i], count=1)
            found.append(family)
            stripped = True
            break
        if not stripped:
            break
    return "\n".join(lines), found
