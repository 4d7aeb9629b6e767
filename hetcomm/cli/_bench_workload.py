"""``hetcomm bench`` workloads: the known data patterns, the timed calls (out-of-place and in-place) and the #wrong check."""

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
from hetcomm.cli._bench_config import BenchConfig


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
