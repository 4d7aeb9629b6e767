"""Run by test_launch.py under torchrun: never imports hetcomm (the entry point registers it)."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("hetcomm")  # env:// from torchrun
rank, n = dist.get_rank(), dist.get_world_size()
x = torch.arange(2 * n, dtype=torch.float32) + 10 * rank
y = torch.empty_like(x)
dist.all_to_all_single(y, x)
expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 10 * j for j in range(n)])
t = torch.ones(1) * rank
dist.all_reduce(t)
# torch >= 2.14: hetcomm's c10d Backend inside torch's ProcessGroup; 2.13: the group itself
face = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
ok = torch.equal(y, expect) and t.item() == n * (n - 1) / 2 and (
    face == "HetcommBackend" if hasattr(dist.ProcessGroup, "shrink") or torch.__version__ >= "2.14" else type(dist.group.WORLD).__name__ == "HetcommProcessGroup"
)
print(f"rank {rank} {'OK' if ok else 'BAD'} {'hetcomm' in sys.modules}", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
