"""Lose the h800 node of benchmarks/elastic_shrink_run.sh after step 12 (see there).

    python benchmarks/elastic_shrink_kill.py [KILL|STOP|RETURN]

KILL (default): SIGKILL the node's launcher, agent and worker; the node does not come back. STOP:
SIGSTOP them (the node hangs as a whole: survivors see silence, not an exit); once the survivors'
job has finished, the stopped processes are SIGKILLed so that nothing is left behind. RETURN: as
KILL, then, once the job runs on 3 ranks and has finished 10 steps there, the node comes back
rebooted: its shared memory emptied, its launcher started again in its namespace with the
command and environment it had (``hetcomm launch --nnodes 2:3``), so the next rendezvous admits
it and the job grows back to 4 ranks. Writes $W/kill.json (RETURN: also when the node came back,
when the first 4-rank step was seen, and the returned launcher's exit code).
"""
import json
import os
import signal
import subprocess
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


def log():
    try:
        return read_metrics(W + "/m.jsonl")
    except Exception:
        return None


def world_of(rec):
    return len(rec.step_s_by_rank or [])


def launcher_of(pids):
    """(argv, env, cwd, netns name) of the node's ``hetcomm launch`` among ``pids``, or None."""
    for pid in pids:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]
        if b"hetcomm.cli.main" in cmd and b"launch" in cmd:
            env = dict(e.split(b"=", 1) for e in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in e)
            ns = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()
            return ([c.decode() for c in cmd], {k.decode(): v.decode() for k, v in env.items()},
                    os.readlink(f"/proc/{pid}/cwd"), ns)
    return None


t = time.time()
while time.time() - t < 600 and last() < 12:
    time.sleep(0.2)
print("at step", last(), flush=True)
vs = victims()
print(f"{HOW} {vs}", flush=True)
again = launcher_of(vs) if HOW == "RETURN" else None
t_kill = time.time()
for v in vs:
    try:
        os.kill(v, signal.SIGSTOP if HOW == "STOP" else signal.SIGKILL)
    except OSError:
        pass
out = {"t_kill": t_kill, "step": last(), "how": HOW}
json.dump(out, open(W + "/kill.json", "w"))
if HOW == "RETURN":
    # Wait until the job runs on 3 ranks and has finished 10 steps there.
    t = time.time()
    while time.time() - t < 600:
        lg = log()
        three = [s.step for s in (lg.all_steps if lg else []) if world_of(s) == 3]
        if len(three) >= 10:
            break
        time.sleep(0.5)
    argv, env, cwd, ns = again
    node = env["HETCOMM_EMULATE_NODE"]
    shm = f"/dev/shm/{env['HETCOMM_EMULATE']}-{node}"
    for name in os.listdir(shm):  # a rebooted node: its shared memory is empty
        subprocess.run(["rm", "-rf", os.path.join(shm, name)], check=False)
    seen = len(log().all_steps)
    out.update(t_return=time.time(), step_return=last())
    print(f"node {node} returns at step {last()} (netns {ns})", flush=True)
    child = subprocess.Popen(["ip", "netns", "exec", ns, "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', shm,
                              *argv], env=env, cwd=cwd,
                             stdout=open(W + "/returned.log", "w"), stderr=subprocess.STDOUT)
    while child.poll() is None:
        lg = log()
        if lg and "t_four" not in out and any(world_of(s) == 4 for s in lg.all_steps[seen:]):
            four = next(s for s in lg.all_steps[seen:] if world_of(s) == 4)
            out.update(t_four=time.time(), step_four=four.step)
            print(f"first 4-rank step {four.step}, {out['t_four'] - out['t_return']:.1f} s after the return", flush=True)
        time.sleep(0.2)
    out["returned_exit"] = child.returncode
    print("returned launcher exit", child.returncode, flush=True)
    json.dump(out, open(W + "/kill.json", "w"))
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
