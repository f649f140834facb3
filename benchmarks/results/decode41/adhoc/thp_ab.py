import mmap, time, torch, os, statistics
from egmla import kernels
kernels.load()
torch.manual_seed(0)
dt = torch.bfloat16 if os.environ.get("DT", "b") == "b" else torch.float32
def arena(tensors, huge):
    total = sum(t.numel() * t.element_size() for t in tensors)
    size = (total + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge: mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    out, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        v = buf[off:off + n].view(t.dtype).view(t.shape); v.copy_(t); out.append(v); off += n
    return mm, out
# a decode step's weights: 30 layers of q,k,v,o,gate,up,down + lm_head
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
ws = [torch.randn(s).to(dt) for s in shapes]
x = torch.randn(1, 576).to(dt); x2 = torch.randn(1, 1536).to(dt)
A = {"plain": (None, ws), "huge": arena(ws, True), "mmap4k": arena(ws, False)}
def step(wl):
    for w in wl: torch.ops.egmla.gemv(x if w.shape[1] == 576 else x2, w)
res = {}
for rep in range(7):
    for name, (_, wl) in A.items():
        t = time.perf_counter(); step(wl); res.setdefault(name, []).append(time.perf_counter() - t)
byts = sum(w.numel() * w.element_size() for w in ws)
print(dt, {k: f"{byts / statistics.median(v) / 1e9:.1f} GB/s ({statistics.median(v)*1e3:.2f} ms)" for k, v in res.items()})
print([l for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
