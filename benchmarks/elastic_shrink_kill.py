"""Lose the h800 node of benchmarks/elastic_shrink_run.sh for good after step 12 (see there).

    python benchmarks/elastic_shrink_kill.py [KILL|STOP]

KILL (default): SIGKILL the node's launcher, agent and worker. STOP: SIGSTOP them (the node hangs
as a whole: survivors see silence, not an exit); once the survivors' job has finished, the
stopped processes are SIGKILLed so that nothing is left behind. Writes $W/kill.json.
"""
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetcomm.ops.metrics import read_metrics  # noqa: E402

W = os.environ.get("W", "/tmp/ft-shrink")
HOW = (sys.argv[1] if len(sys.argv) > 1 else "KILL").upper()
STEPS = int(os.environ.get("STEPS", "80"))


def last():
    try:
        return read_metrics(W + "/m.jsonl").all_steps[-1].step
    except Exception:
        return 0


def victims():
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        mine = (W + "/h800-0").encode()  # this run's node only, not another emulation's h800-0
        if mine not in cmd and b"HETCOMM_LAUNCH_DIR=" + mine not in env:
            continue
        if b"HETCOMM_EMULATE_NODE=h800-0" in env and (b"hetcomm.cli.main\0launch" in cmd or b"torch.distributed.run" in cmd
                                                       or b"hetcomm.cli.launch_worker" in cmd):
            out.append(int(pid))
    return out


t = time.time()
while time.time() - t < 600 and last() < 12:
    time.sleep(0.2)
print("at step", last(), flush=True)
vs = victims()
print(f"{HOW} {vs}", flush=True)
t_kill = time.time()
for v in vs:
    try:
        os.kill(v, signal.SIGSTOP if HOW == "STOP" else signal.SIGKILL)
    except OSError:
        pass
json.dump({"t_kill": t_kill, "step": last(), "how": HOW}, open(W + "/kill.json", "w"))
if HOW == "STOP":
    t = time.time()
    while time.time() - t < 900 and last() < STEPS:
        time.sleep(0.5)
    for v in vs:
        try:
            os.kill(v, signal.SIGKILL)
        except OSError:
            pass
    print("survivors at step", last(), "; stopped processes killed", flush=True)
