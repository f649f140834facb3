import torch, time
from egmla import kernels
from egmla.quant import quantize_q8_0, quantize_q4_1
torch.set_num_threads(2)
def bench(f, n=10):
    f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n
for name, q in (("q8_0", quantize_q8_0), ("q4_1", quantize_q4_1)):
    ws = [q(torch.randn(1536, 576) * 0.05) for _ in range(8)] + [q(torch.randn(576, 1536) * 0.05) for _ in range(4)]
    for M in (16, 32, 64, 128, 256):
        x = torch.randn(M, 576); x2 = torch.randn(M, 1536)
        xs = lambda w: x if w.shape[1] == 576 else x2
        a = bench(lambda: [kernels.gemv_quant(xs(w), w) for w in ws])
        b = bench(lambda: [kernels.quant_matmul(xs(w), w) for w in ws])
        print(f"{name} M={M}: kernel {a*1e3:.2f} ms  pytorch {b*1e3:.2f} ms  ratio {a/b:.2f}")
