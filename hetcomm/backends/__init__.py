"""The ``hetcomm`` torch.distributed backend and its rails."""
