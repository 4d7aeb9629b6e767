"""The expert bank's block layout and the recycled row buffers behind the data path."""

from __future__ import annotations

import torch
from torch import nn

from hetcomm.backends import rowpool as buffers
from hetcomm.backends.rowpool import BufferPool
from hetcomm.moe.routing import gather_rows, weighted_combine
from hetcomm.moe.experts import ExpertBank, cat_rows, split_rows


def _bank(num_experts: int, dim: int = 8) -> ExpertBank:
    torch.manual_seed(0)
    return ExpertBank([nn.Sequential(nn.Linear(dim, 5), nn.GELU(), nn.Linear(5, dim)) for _ in range(num_experts)])


def test_blocks_run_each_expert_once_on_its_rows_and_return_arrival_order():
    # 3 sources, 2 local experts; source-major blocks s0e0 s0e1 | s1e0 s1e1 | s2e0 s2e1.
    counts = [[2, 1], [0, 3], [1, 0]]
    bank = _bank(2)
    x = torch.randn(7, 8, requires_grad=True)
    calls = []
    for i, m in enumerate(bank.experts):
        m.register_forward_hook(lambda mod, inp, out, i=i: calls.append((i, inp[0].size(0))))
    y = bank.forward_blocks(x, counts)
    assert calls == [(0, 3), (1, 4)]  # one call per expert, all of its rows
    expert_of_row = [0, 0, 1, 1, 1, 1, 0]
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.stack([bank.experts[e](x_ref[i : i + 1])[0] for i, e in enumerate(expert_of_row)])
    torch.testing.assert_close(y, y_ref)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    (y_ref * gy).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_blocks_without_rows_keep_the_input_in_the_graph():
    bank = _bank(2)
    x = torch.randn(0, 8, requires_grad=True)
    y = bank.forward_blocks(x, [[0, 0], [0, 0]])
    assert y.shape == (0, 8) and y.requires_grad
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 8)


def test_split_and_cat_rows_match_torch_with_gradients():
    x = torch.randn(9, 4, requires_grad=True)
    a, b, c = split_rows(x, [2, 0, 7])
    y = cat_rows([a * 2, b, c * 3])
    y.sum().backward()
    torch.testing.assert_close(y, torch.cat([x[:2] * 2, x[2:] * 3]))
    torch.testing.assert_close(x.grad, torch.cat([torch.full((2, 4), 2.0), torch.full((7, 4), 3.0)]))


def test_gather_and_weighted_combine_match_autograd():
    torch.manual_seed(1)
    T, S = 50, 600  # S spans several blocks of the blocked combine (256 rows each)
    x = torch.randn(T, 16, requires_grad=True)
    idx = torch.randint(0, T, (S,))
    w = torch.rand(S, requires_grad=True)
    out = weighted_combine(gather_rows(x, idx) * 1.5, w, idx, T)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = torch.zeros(T, 16).index_add(0, idx, x2[idx] * 1.5 * w2[:, None])
    torch.testing.assert_close(out, ref)
    g = torch.randn(T, 16)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_pool_reuses_a_buffer_only_when_nothing_references_it():
    pool = BufferPool()
    rows = (buffers.MIN_POOL_BYTES // 4096) * 2  # [rows, 1024] FP32: 2x the pooling threshold
    a = pool.empty((rows, 1024))
    b = pool.empty((rows, 1024))
    assert a.data_ptr() != b.data_ptr() and a._base is None and a.is_contiguous()
    ptr = a.data_ptr()
    view = a[:3]
    del a
    c = pool.empty((rows, 1024))
    assert c.data_ptr() != ptr, "reused a buffer a view still points into"
    del view
    d = pool.empty((rows - 7, 1024))  # a little smaller: same buffer
    assert d.data_ptr() == ptr and d.shape == (rows - 7, 1024)
    # Saved for backward by autograd: not reused until the graph is gone.
    p = torch.randn(rows - 7, 1024, requires_grad=True)
    loss = (p * d).sum()
    del d
    assert pool.empty((rows, 1024)).data_ptr() != ptr
    loss.backward()
    del loss
    assert pool.empty((rows, 1024)).data_ptr() == ptr
    total, used = pool.held_bytes()
    assert total >= 3 * rows * 1024 * 4 and used <= total
    del b, c
    assert pool.release() > 0
    # Small requests bypass the pool.
    assert pool.empty((4, 4)).shape == (4, 4)
