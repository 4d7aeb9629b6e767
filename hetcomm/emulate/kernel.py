"""Thin wrappers around ``ip`` and ``tc``: run them, and turn their failures into clear errors.

Every call names the namespace it works in (``ip -n NS``); nothing here ever addresses the root
namespace's interfaces, routes or addresses. Commands go to the kernel in batches (``ip -batch``,
``tc -batch``), one per namespace and step, so that bringing up an 80-rank cluster is a few dozen
processes rather than a thousand.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import List, Optional, Sequence

from hetcomm.errors import HetcommError, UsageError

__all__ = [
    "KernelError",
    "check_prerequisites",
    "run_tool",
    "batch",
    "list_netns",
    "netns_pids",
]

# ``ip`` and ``tc`` answer in milliseconds; 60 s means the machine is stuck, not busy.
_TOOL_TIMEOUT_S = 60.0


class KernelError(HetcommError, RuntimeError):
    """An ``ip``/``tc`` command the emulator issued was refused by the kernel."""


def check_prerequisites() -> None:
    """Refuse clearly unless this process can build an emulation (Linux, root, ip, tc, mount).

    Raises:
        UsageError: naming what is missing and how to get it.
    """
    missing: List[str] = []
    if platform.system() != "Linux":
        raise UsageError(
            f"'hetcomm emulate' needs Linux network namespaces; this is {platform.system()}"
        )
    if os.geteuid() != 0:
        missing.append("root (creating network namespaces needs CAP_NET_ADMIN; run with sudo)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("mount", "util-linux")):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command (install {pkg})")
    if not os.path.isdir("/dev/shm"):
        missing.append("/dev/shm (a tmpfs for the shm rail)")
    if missing:
        raise UsageError("'hetcomm emulate' cannot run here: missing " + "; ".join(missing))


def run_tool(argv: Sequence[str], *, check: bool = True, stdin: Optional[str] = None) -> str:
    """Run one ``ip``/``tc`` command; return its stdout.

    Raises:
        KernelError: with the command line and the tool's own message, when ``check`` and the
            command failed.
    """
    try:
        proc = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_TOOL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise KernelError(f"'{' '.join(argv)}' did not finish in {_TOOL_TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        raise KernelError(
            f"'{' '.join(argv)}' failed (exit {proc.returncode}): "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def batch(tool: str, ns: str, lines: Sequence[str]) -> None:
    """Run ``lines`` through ``<tool> -n <ns> -batch -`` (tool is ``ip`` or ``tc``).

    Raises:
        KernelError: naming the namespace and the failing line.
    """
    if not lines:
        return
    text = "\n".join(lines) + "\n"
    try:
        proc = subprocess.run(
            [tool, "-n", ns, "-batch", "-"],
            input=text,
            capture_output=True,
            text=True,
            timeout=_TOOL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise KernelError(
            f"'{tool} -n {ns} -batch' did not finish in {_TOOL_TIMEOUT_S:.0f} s"
        ) from None
    if proc.returncode != 0:
        raise KernelError(
            f"'{tool} -n {ns}' refused a command in namespace {ns}: {proc.stderr.strip()}\n"
            f"commands were:\n  " + "\n  ".join(lines)
        )


def list_netns() -> List[str]:
    """Names of every named network namespace (``ip netns list``)."""
    out = run_tool(["ip", "netns", "list"], check=False)
    # Lines look like "hc3f9a1c-a100-0 (id: 4)" or just the name.
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> List[int]:
    """Processes running inside namespace ``ns`` (``ip netns pids``)."""
    out = run_tool(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]
