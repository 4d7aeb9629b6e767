import torch, time
from tests.backends.ranks import run_ranks, MIXED_MINI
def body(rank, W):
    import cProfile, pstats, io
    from hetcomm.moe import MoELayer, FFNExpert
    torch.set_num_threads(1)
    E,D,F,T=64,1024,256,4096
    l=MoELayer(D,E,expert=lambda d: FFNExpert(d,F), strong_expert_weight=1.0, wire_dtype="fp32", calibrate=False)
    x=torch.randn(T,D,requires_grad=True)
    def step():
        y=l(x); (y.square().mean()+0.01*l.l_aux).backward()
    step()
    pr=cProfile.Profile(); t=time.perf_counter(); pr.enable(); step(); pr.disable(); dt=time.perf_counter()-t
    s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats('tottime').print_stats(14)
    return dt, l.step_stats()['comm_exposed_s'], s.getvalue() if rank==0 else ''
if __name__=='__main__':
    for r in run_ranks(body,4,backend='hetcomm',cluster=MIXED_MINI,timeout=300):
        print(r[0], r[1]); print(r[2][:3500])
