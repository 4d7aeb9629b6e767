"""Derive the doctor's firing traces from recorded ones (the tests call :func:`main` into a
temporary directory; by hand: ``.venv/bin/python tests/ops/traces/make_traces.py OUT_DIR``).

Inputs, recorded:
    tests/ops/traces/demo_clean.jsonl           ``hetcomm train --metrics`` of the demo (200 steps)
    tests/fixtures/nccl_log_g6e_l40s_shm.txt    a real NCCL_DEBUG=INFO log, every init completes
    tests/fixtures/nccl_log_h100_2node_roce_gdrdma_p2pipc.txt   real RoCE log, GID index 3 set
    tests/ops/traces/store_reverse_dns.log      an emulated 4-rank run's output with c10d's failed lookup

Outputs (each changes one thing of a recorded trace, named after the rule it fires):
    jitter.jsonl           every 6th step after step 30: +2 s in grad_sync on rank 0, rank 2 slowest
    starved.jsonl          layer 1's expert 5 receives 0.2% of the copies (the rest shared out)
    migrations.jsonl       migrations every 30 steps from 40, each followed by a 2-step loss jump;
                           migrations_quiet.jsonl: the same migrations, loss unchanged
    prefetch_on.jsonl      the demo's run line with ``"prefetch": true`` in its config
    big_alltoall.jsonl     bytes per step x 2000 (a real-size model's all-to-all on the 910B rank)
    nccl_init_hang.txt     the g6e log cut after two of the four ranks' 'Init COMPLETE'
    nccl_roce_no_gid.txt   the RoCE log without its NCCL_IB_GID_INDEX lines
    store_dns_ok.log       the emulated run's output without c10d's failed lookup (the quiet case)
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(os.path.dirname(os.path.dirname(HERE)), "fixtures")


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _write(out_dir, name, lines):
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _records(transform):
    out = []
    for text in _lines(os.path.join(HERE, "demo_clean.jsonl")):
        obj = json.loads(text)
        transform(obj)
        out.append(json.dumps(obj, separators=(",", ":")))
    return out


def jitter(o):
    if o["kind"] == "step" and o["step"] > 30 and o["step"] % 6 == 0:
        o["phase_s"]["grad_sync"] += 2.0
        o["step_s"] += 2.0
        o["step_s_by_rank"] = [t + 2.0 for t in o["step_s_by_rank"]]
        o["step_s_by_rank"][2] += 0.05


def starved(o):
    if o["kind"] == "step":
        load = o["expert_load"][1]
        total = sum(load)
        keep = round(total * 0.002)
        spare = load[5] - keep
        load[5] = keep
        for e in range(len(load)):
            if e != 5:
                load[e] += spare / (len(load) - 1)


def migrations(bump):
    def f(o):
        if o["kind"] == "step":
            s = o["step"]
            o["migrations"] = 2 if s >= 40 and (s - 40) % 30 == 0 else 0
            if bump and s >= 41 and (s - 41) % 30 in (0, 1):
                o["loss"] += 0.6
    return f


def prefetch(o):
    if o["kind"] == "run":
        o["config"]["prefetch"] = True


def big(o):
    if o["kind"] == "step":
        o["bytes_by_link_class"] = {k: v * 2000 for k, v in o["bytes_by_link_class"].items()}
        o["bytes_by_rail"] = {k: v * 2000 for k, v in o["bytes_by_rail"].items()}


def main(out_dir: str) -> None:
    _write(out_dir, "jitter.jsonl", _records(jitter))
    _write(out_dir, "starved.jsonl", _records(starved))
    _write(out_dir, "migrations.jsonl", _records(migrations(True)))
    _write(out_dir, "migrations_quiet.jsonl", _records(migrations(False)))
    _write(out_dir, "prefetch_on.jsonl", _records(prefetch))
    _write(out_dir, "big_alltoall.jsonl", _records(big))
    g6e = _lines(os.path.join(FIX, "nccl_log_g6e_l40s_shm.txt"))
    cut = next(i for i, ln in enumerate(g6e) if "rank 2 nranks 4" in ln and "Init COMPLETE" in ln)
    _write(out_dir, "nccl_init_hang.txt", ["# derived: tests/fixtures/nccl_log_g6e_l40s_shm.txt cut where ranks 1 and 3 had not completed init"] + g6e[1 : cut + 1])
    roce = _lines(os.path.join(FIX, "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt"))
    _write(out_dir, "nccl_roce_no_gid.txt", ["# derived: tests/fixtures/nccl_log_h100_2node_roce_gdrdma_p2pipc.txt without NCCL_IB_GID_INDEX"] + [ln for ln in roce[1:] if "NCCL_IB_GID_INDEX" not in ln])
    store = _lines(os.path.join(HERE, "store_reverse_dns.log"))
    _write(out_dir, "store_dns_ok.log", [ln for ln in store if "[c10d] The hostname" not in ln])


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
