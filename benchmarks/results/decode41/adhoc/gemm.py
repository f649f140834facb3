import torch, time
torch.set_num_threads(2)
def bench(f, n=20):
    for _ in range(3): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n
for M in (32, 128, 512):
    for N, K in ((1536, 576), (576, 1536), (576, 576)):
        x = torch.randn(M, K); w = torch.randn(N, K); wt = w.t().contiguous()
        a = bench(lambda: torch.nn.functional.linear(x, w))
        b = bench(lambda: x @ wt)
        macs = M * N * K
        print(f"M={M} N={N} K={K}: F.linear {macs/a/1e9:.1f} GMAC/s   x@wT(contig) {macs/b/1e9:.1f}")
a = torch.randn(2048, 2048); b = torch.randn(2048, 2048)
t = bench(lambda: a @ b, 5); print("2048^3", 2048**3/t/1e9)
print(torch.__config__.show()[:600])
