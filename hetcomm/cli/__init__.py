"""Command-line interface: ``hetcomm topo | audit | bench | simulate | train | emulate``."""
