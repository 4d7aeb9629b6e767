#!/bin/sh
# Elastic shrink on the emulated mixed-mini (issue 20, "a node that does not come back"): one
# `hetcomm launch --nnodes 2:3` per node; run benchmarks/elastic_shrink_kill.py beside it, which
# SIGKILLs the h800 node (launcher, agent, worker) after step 12 (RETURN: and brings it back later).
# STEPS: the job's steps (default 80). Needs root (hetcomm emulate).
cd "$(dirname "$0")/.."
W=${W:-/tmp/ft-shrink}
rm -rf $W/ck $W/m.jsonl $W/a100-0 $W/h800-0 $W/ascend-0 $W/st
NODE_CMD='if [ "$LOCAL_RANK" != 0 ]; then exit 0; fi; '"$PWD/.venv/bin/python"' -m hetcomm.cli.main launch --cluster configs/clusters/mixed-mini.yaml --node "$HETCOMM_EMULATE_NODE" --nnodes 2:3 --rdzv-endpoint "$MASTER_ADDR:29479" --rdzv-id shrink1 --local-addr "${HETCOMM_EMULATE_ADDRS%%,*}" --no-health --max-restarts 3 --work-dir '$W'/$HETCOMM_EMULATE_NODE -- train --config tests/ops/tiny.yaml --steps '${STEPS:-80}' --checkpoint-dir '$W'/ck --checkpoint-every 5 --resume --metrics '$W'/m.jsonl || true'
exec .venv/bin/python -m hetcomm.cli.main emulate run --cluster configs/clusters/mixed-mini.yaml --state-dir $W/st --timeout 900 -- sh -c "$NODE_CMD"
