"""Run by test_launch.py under torchrun: never imports hetcomm (the entry point registers it)."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("hetcomm")  # env:// from torchrun
loaded = "hetcomm" in sys.modules  # by torch's entry point, never by this script
rank, n = dist.get_rank(), dist.get_world_size()
x = torch.arange(2 * n, dtype=torch.float32) + 10 * rank
y = torch.empty_like(x)
dist.all_to_all_single(y, x)
expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 10 * j for j in range(n)])
t = torch.ones(1) * rank
dist.all_reduce(t)
# torch >= 2.14: hetcomm's c10d Backend inside torch's ProcessGroup; 2.13: the group itself
faces = sys.modules["hetcomm.backends.process_group"] if loaded else None
if faces is not None and faces.backend_subclassable():
    face_ok = type(dist.group.WORLD._get_backend(torch.device("cpu"))) is faces.HetcommBackend
else:
    face_ok = faces is not None and type(dist.group.WORLD) is faces.HetcommProcessGroup
ok = torch.equal(y, expect) and t.item() == n * (n - 1) / 2 and face_ok
print(f"rank {rank} {'OK' if ok else 'BAD'} {loaded}", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
