"""Kill the h800 node of benchmarks/elastic_shrink_run.sh for good after step 12 (see there)."""
import os, signal, sys, time, json
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetcomm.ops.metrics import read_metrics
W="/tmp/ft-shrink"
def last():
    try: return read_metrics(W+"/m.jsonl").all_steps[-1].step
    except Exception: return 0
t=time.time()
while time.time()-t<600 and last()<12: time.sleep(0.2)
print("at step", last(), flush=True)
# the h800 node's launcher and everything under it (it is in namespace h800-0)
victims=[]
for pid in os.listdir("/proc"):
    if not pid.isdigit(): continue
    try:
        env=open(f"/proc/{pid}/environ","rb").read().split(b"\0")
        cmd=open(f"/proc/{pid}/cmdline","rb").read()
    except OSError: continue
    if b"HETCOMM_EMULATE_NODE=h800-0" in env and (b"hetcomm.cli.main\0launch" in cmd or b"torch.distributed.run" in cmd or b"hetcomm.cli.launch_worker" in cmd):
        victims.append(int(pid))
print("killing", victims, flush=True)
t_kill=time.time()
for v in victims:
    try: os.kill(v, signal.SIGKILL)
    except OSError: pass
json.dump({"t_kill": t_kill, "step": last()}, open(W+"/kill.json","w"))
