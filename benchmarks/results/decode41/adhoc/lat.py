import torch, time
from egmla import kernels
kernels.load()
H, C, r, S = 12, 256, 64, 4096
c = torch.randn(S, C); kr = torch.randn(S, r); q = torch.randn(1, H, C + r) * 0.1
slots = torch.arange(S)[None]; lengths = torch.tensor([S])
for th in (1, 2):
    torch.set_num_threads(th)
    f = lambda: kernels.paged_latent_attention(q, c, kr, slots, lengths, 0.1)
    for _ in range(5): f()
    t = time.perf_counter(); n = 200
    for _ in range(n): f()
    dt = (time.perf_counter() - t) / n
    macs = S * H * (2 * C + r)
    print(th, f"{dt*1e3:.3f} ms  {macs/dt/1e9:.1f} GMAC/s")
