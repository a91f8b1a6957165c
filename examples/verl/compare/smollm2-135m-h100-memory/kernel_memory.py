"""Device memory a process gains from the first use of a torch op (kernel code the driver loads), by op.

Each case runs in a fresh process: CUDA init plus a warm-up (an empty tensor, a copy_), then the
device's used memory (NVML, this process alone on the GPU) before and after the case's op, after
synchronize + empty_cache. Prints MiB deltas. Usage: python kernel_memory.py [reps] (alone on GPU 0; needs torch and nvidia-ml-py)
"""
import json, os, subprocess, sys, time

CASES = {
    "noop": "pass",
    "copy_bf16": "d.copy_(s)",
    "cat_bf16 (verl built-in trainer: FlattenedTensorBucket)": "torch.cat([x.view(-1) for x in srcs])",
    "cat_out_bf16": "torch.cat([x.view(-1) for x in srcs], out=flat)",
    "foreach_copy_bf16 (ours: trainer gather)": "torch._foreach_copy_(views, srcs)",
    "split_with_sizes_copy_int16 (ours: receiver scatter)": "torch.split_with_sizes_copy(flat.view(torch.int16), sizes, out=outs16)",
    "foreach_copy_int16 (ours: receiver, non-tiling)": "torch._foreach_copy_(outs16, list(torch.split(flat.view(torch.int16), sizes)))",
    "fill_uint8": "flat.view(torch.uint8)[:100].fill_(0)",
    "zeros_uint8 + copy from cpu (status block)": "st = torch.zeros(1<<20, dtype=torch.uint8, device='cuda'); st[:10].copy_(torch.arange(10, dtype=torch.uint8))",
    "reduce_tensor share (ours/built-in: IPC export)": "from torch.multiprocessing.reductions import reduce_tensor; h = reduce_tensor(flat)",
    "unflatten_dense_tensors views": "vs = torch._C._nn.unflatten_dense_tensors(flat, srcs)",
}

SETUP = """
import torch, pynvml
pynvml.nvmlInit(); H = pynvml.nvmlDeviceGetHandleByIndex(0)
def used():
    torch.cuda.synchronize(); torch.cuda.empty_cache(); time.sleep(0.3)
    return pynvml.nvmlDeviceGetMemoryInfo(H).used
import time
torch.zeros(1, device='cuda')
shapes = [(576, 576)] * 60 + [(1536, 576)] * 90 + [(49152, 576)] + [(576,)] * 61
srcs = [torch.randn(s, device='cuda', dtype=torch.bfloat16) for s in shapes]
n = sum(x.numel() for x in srcs)
flat = torch.empty(n, device='cuda', dtype=torch.bfloat16)
views = list(torch.split(flat, [x.numel() for x in srcs]))
views = [v.view(x.shape) for v, x in zip(views, srcs)]
sizes = [x.numel() for x in srcs]
outs16 = [torch.empty(k, device='cuda', dtype=torch.int16) for k in sizes]
d = torch.empty_like(srcs[0]); s = srcs[1]
d.copy_(s)
u0 = used()
{CASE}
u1 = used()
print("RESULT", json.dumps(dict(before=u0, after=u1)))
"""

def run(case_src):
    code = "import json\n" + SETUP.replace("{CASE}", case_src)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT"):
            r = json.loads(line.split(" ", 1)[1])
            return (r["after"] - r["before"]) / 2**20
    return "error: " + out.stderr[-500:]

if __name__ == "__main__":
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    res = {}
    for name, src in CASES.items():
        res[name] = [run(src) for _ in range(reps)]
        print(f"{name}: {res[name]} MiB", flush=True)
    print(json.dumps(res))

IPC = r"""
import json, os, sys, time, torch, pynvml
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor
pynvml.nvmlInit(); H = pynvml.nvmlDeviceGetHandleByIndex(0)
def mine(pid):
    time.sleep(0.3)
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(H):
        if p.pid == pid: return p.usedGpuMemory
    return 0
def child(q, r):
    torch.zeros(1, device='cuda'); d = torch.empty(10, device='cuda'); d.copy_(d)
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    a = mine(os.getpid())
    fn, args = q.get()
    buf = fn(*args)
    buf[:10].sum().item(); torch.cuda.synchronize()
    b = mine(os.getpid())
    del buf; import gc; gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
    c = mine(os.getpid())
    r.put((a, b, c))
if __name__ == "__main__":
    mp.set_start_method("spawn")
    q, r = mp.Queue(), mp.Queue()
    torch.zeros(1, device='cuda')
    p = mp.Process(target=child, args=(q, r)); p.start()
    buf = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')
    p0 = mine(os.getpid())
    q.put(reduce_tensor(buf))
    a, b, c = r.get(); p.join()
    del buf; torch.cuda.ipc_collect(); torch.cuda.empty_cache()
    p1 = mine(os.getpid())
    print("RESULT", json.dumps(dict(child_before=a, child_open=b, child_closed=c, parent_with_buf=p0, parent_after=p1)))
"""

def run_ipc(nbytes):
    open("/tmp/kernel_memory_ipc.py", "w").write(IPC)
    out = subprocess.run([sys.executable, "/tmp/kernel_memory_ipc.py", str(nbytes)], capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT"):
            r = json.loads(line.split(" ", 1)[1])
            return {k: round(v / 2**20, 1) for k, v in r.items()}
    return "error: " + out.stderr[-800:]

if __name__ == "__main__" and os.environ.get("MODMEM_IPC", "1") == "1":
    for nb in (1 << 20, 269 << 20):
        print(f"ipc {nb >> 20} MiB buffer (MiB per process):", run_ipc(nb), flush=True)
