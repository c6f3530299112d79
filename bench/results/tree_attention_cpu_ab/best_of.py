"""Best-of-N times of eagle tree_attention and the SDPA-with-mask baseline at the SmolLM2 shapes.

Run from a repository root: python best_of.py THREADS [bf16]
"""
import sys, time, torch
sys.path.insert(0, "bench")
import bench_tree_attention as bt
import eagle_kernels
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
dt = torch.bfloat16 if "bf16" in sys.argv else torch.float32
shapes = [(1,16,512),(1,16,2048),(1,60,512),(1,60,2048),(4,16,2048),(4,60,2048),(1,1,2048),(1,8,2048)]
for B,N,p in shapes:
    case = bt.make_case(B,N,p,bt.CPU_HEADS,dt,None,"cpu")
    q,k,v,s,m,t = case
    def best(fn, n=30):
        fn(q,k,v,s,m,block_table=t); b=1e9
        for _ in range(n):
            t0=time.perf_counter(); fn(q,k,v,s,m,block_table=t); b=min(b,time.perf_counter()-t0)
        return b
    te=best(eagle_kernels.tree_attention); ts=best(bt.sdpa_tree_attention, 10)
    fl = 4*B*N*9*64*(p+N/2)
    print(f"B{B}-N{N}-p{p}: eagle {te*1e3:.3f} ms ({fl/te/1e9:.0f} GFLOP/s)  sdpa {ts*1e3:.3f} ms  {ts/te:.2f}x", flush=True)
