"""The demo training job behind ``hetcomm train``: a small MoE language model on a synthetic task."""
