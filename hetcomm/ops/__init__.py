"""Operating a job: per-step metrics and plots, checkpoints, the doctor, the staged launch.

Modules (each one job):
    metrics     the per-step record schema (:class:`~hetcomm.ops.metrics.StepRecord`), its
                JSON-lines writer/reader and the in-job collector
    plots       the four PNGs and the text summary of a metrics file (``hetcomm report``)
    checkpoint  sharded checkpoints of the MoE job through ``torch.distributed.checkpoint``
    doctor      the troubleshooting table as rules over a job's record (``hetcomm doctor``)
    health      all-reduce / all-to-all probes per rank and link class (``hetcomm launch``)

This package sits after ``train`` in the dependency chain (topo -> sched -> backends -> moe ->
train/ops/cli): nothing below imports it.
"""
