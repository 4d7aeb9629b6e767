"""Destroying a hetcomm group waits for the completions still running on gloo's threads.

An async delegated collective completes on a gloo thread, and its Work's future runs the
caller's callbacks there (PowerSGD's hook chains three collectives that way). If the caller
destroys its groups meanwhile, that thread may drop the last reference to a group and
``~ProcessGroupGloo`` joins its own thread: ``Resource deadlock avoided``, the process aborted
(``tests/moe/test_powersgd.py`` once in CI). The group face's ``shutdown`` therefore waits
for those callbacks (``hetcomm.backends.delegated._InFlight``).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from tests.backends.ranks import run_ranks


def _rank_destroy_during_a_callback(rank: int, world_size: int) -> dict:
    started, finished = threading.Event(), threading.Event()

    def slow(fut):
        started.set()
        time.sleep(0.5)
        finished.set()
        return fut.value()

    t = torch.ones(4)
    if rank == 1:
        time.sleep(0.3)  # rank 0's Work is still pending when it attaches its callback
    fut = dist.all_reduce(t, async_op=True).get_future().then(slow)
    if not started.wait(30):
        return {"started": False}
    inline = threading.current_thread() is threading.main_thread() and finished.is_set()
    dist.destroy_process_group()
    return {"started": True, "finished_at_destroy": finished.is_set(), "inline": inline,
            "value": fut.wait()[0].tolist()}


def test_destroy_waits_for_a_callback_running_on_a_gloo_thread():
    outs = run_ranks(_rank_destroy_during_a_callback, world_size=2, timeout=120)
    r0 = outs[0]
    assert r0["started"] and not r0["inline"], r0  # the callback ran on another thread, while rank 0 waited
    assert r0["finished_at_destroy"], "destroy_process_group returned while a callback still ran on a gloo thread"
    assert r0["value"] == [2.0] * 4


def _rank_destroy_during_a_callback_on_the_executor(rank: int, world_size: int) -> dict:
    """The same when gloo's op has finished before the completion was attached to its future:
    the executor then completes the Work after the job, hands its queue to a new thread and runs
    the callbacks on the old one, which retires (``hetcomm.backends.executor.Executor``). Under
    load that happens by chance; here the inner gloo's allreduce waits for its op before it
    returns, so it happens every time."""
    from torch.distributed import ProcessGroupGloo

    plain = ProcessGroupGloo.allreduce

    def finished_before_return(self, *args):
        work = plain(self, *args)
        work.wait()
        return work

    ProcessGroupGloo.allreduce = finished_before_return
    started, finished = threading.Event(), threading.Event()
    where = []

    def slow(fut):
        where.append(threading.current_thread().name)
        started.set()
        time.sleep(0.5)
        finished.set()
        return fut.value()

    t = torch.ones(4)
    if rank == 1:
        time.sleep(0.3)  # rank 0's Work is still pending when it attaches its callback
    fut = dist.all_reduce(t, async_op=True).get_future().then(slow)
    if not started.wait(30):
        return {"started": False}
    dist.destroy_process_group()
    ProcessGroupGloo.allreduce = plain
    return {"started": True, "finished_at_destroy": finished.is_set(), "where": where,
            "value": fut.wait()[0].tolist()}


def test_destroy_waits_for_a_callback_running_on_a_retiring_executor_thread():
    # before: Executor.close() joined only the thread that had taken the queue over, so
    # destroy_process_group returned at once while the retiring thread still ran the callback
    outs = run_ranks(_rank_destroy_during_a_callback_on_the_executor, world_size=2, timeout=120)
    r0 = outs[0]
    assert r0["started"] and r0["where"][0].startswith("hetcomm-exec"), r0  # the path under test
    assert r0["finished_at_destroy"], "destroy_process_group returned while a callback still ran on a retiring executor thread"
    assert r0["value"] == [2.0] * 4
