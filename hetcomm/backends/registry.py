"""Backend registration (placeholder: the backend issue replaces this module)."""


def register() -> None:
    """Register backend "hetcomm" with torch.distributed (idempotent)."""
