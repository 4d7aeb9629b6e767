"""The row buffer pool never evicts the buffer it just made, and hands a buffer to one user only."""

from __future__ import annotations

import threading

import torch

from hetcomm.backends.rowpool import MIN_POOL_BYTES, BufferPool


def test_pool_never_evicts_the_buffer_it_just_made():
    pool = BufferPool(max_buffers=1)
    n = MIN_POOL_BYTES // 4  # float32 elements: exactly the pooling threshold
    a = pool.empty((n,))
    del a  # its buffer is free now, and the oldest
    b = pool.empty((3 * n,))  # too big for the first: a second buffer, over max_buffers
    del b
    c = pool.empty((3 * n,))  # must reuse the one made for b (the first one was evicted)
    assert pool.num_allocated == 2 and pool.num_reused == 1, (pool.num_allocated, pool.num_reused)
    del c


def test_concurrent_users_never_share_a_buffer():
    pool = BufferPool(max_buffers=4)
    n = MIN_POOL_BYTES // 4
    clashes = []
    live = {}
    lock = threading.Lock()

    def user(k: int) -> None:
        for _ in range(200):
            t = pool.empty((n,))
            ptr = t.untyped_storage().data_ptr()
            with lock:
                if ptr in live:
                    clashes.append(ptr)
                live[ptr] = k
            t.fill_(k)
            with lock:
                del live[ptr]
            del t

    threads = [threading.Thread(target=user, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not clashes


def test_release_drops_free_buffers_of_different_sizes():
    pool = BufferPool(max_buffers=8)
    n = MIN_POOL_BYTES // 4
    held = pool.empty((2 * n,))
    for k in (1, 3, 5):
        t = pool.empty((k * n,))
        del t
    released = pool.release()
    assert released >= 9 * n * 4 and pool.held_bytes()[1] > 0  # `held` stays
    del held
