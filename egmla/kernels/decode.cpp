// Decode-time kernels for the CPU: matrix-vector products (y = x @ w.T for a few rows of x) and
// attention straight from the paged KV cache.
//
// At decode a linear layer multiplies one token's activations (or a few, batched) by a weight
// stored (out, in), as nn.Linear keeps it. The product is bound by reading the weight: for
// each output row the kernel streams one weight row once and takes its dot product with every
// row of x, which stays in L1. PyTorch's own batch-1 path for that layout runs on one thread;
// this one splits the output rows over PyTorch's intra-op threads (at::parallel_for), so both
// cores stream weights.
//
//   torch.ops.egmla.gemv(x, w) -> y                 x (M, K), w (N, K), y (M, N)
//   torch.ops.egmla.gemv_many(x, [w1, w2]) -> [y1, y2]   several weights sharing x, one pass
//   torch.ops.egmla.paged_attention(q, k_pool, v_pool, slots, lengths, scale)   decode attention
//
// Supported: CPU tensors, x and w contiguous and of one dtype, float32 or bfloat16 (bf16 is
// widened to fp32 in registers and accumulated in fp32; the result is rounded to nearest even,
// as PyTorch rounds). The caller (egmla/kernels/__init__.py) routes anything else to
// F.linear, and only calls this when the CPU has AVX2 and FMA.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRows = 4;    // weight rows per block: four streams in flight
constexpr int64_t kMaxBatch = 4;  // x rows per pass: kRows * kMaxBatch accumulators

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 weights as fp32: a plain load, or 8 bf16 widened (a bf16 is the top half of an fp32).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename P>
inline float dot(const float* q, const P* k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  float s = hsum(acc);
  for (; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

// Rows [r0, r0 + R) of w against rows [m0, m0 + B) of x (fp32, K floats each): y[m][r] = dot.
template <int R, int B, typename W>
inline void dot_block(const float* x, const W* w, float* acc_out, int64_t K, int64_t r0) {
  __m256 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[B];
    for (int b = 0; b < B; ++b) xv[b] = _mm256_loadu_ps(x + b * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = load8(w + (r0 + r) * K + k);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm256_fmadd_ps(wv, xv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      float s = hsum(acc[r][b]);
      for (int64_t k = K8; k < K; ++k) s += static_cast<float>(w[(r0 + r) * K + k]) * x[b * K + k];
      acc_out[b * R + r] = s;
    }
  }
}

// One row of w against rows [0, B) of x, k unrolled twice: a single sequential stream.
template <int B, typename W>
inline void dot_row(const float* x, const W* wr, float* out, int64_t K) {
  __m256 acc[2][B];
  for (int u = 0; u < 2; ++u)
    for (int b = 0; b < B; ++b) acc[u][b] = _mm256_setzero_ps();
  const int64_t K16 = K - K % 16;
  int64_t k = 0;
  for (; k < K16; k += 16) {
    __m256 w0 = load8(wr + k), w1 = load8(wr + k + 8);
    for (int b = 0; b < B; ++b) {
      acc[0][b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * K + k), acc[0][b]);
      acc[1][b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + b * K + k + 8), acc[1][b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    float s = hsum(_mm256_add_ps(acc[0][b], acc[1][b]));
    for (int64_t j = k; j < K; ++j) s += static_cast<float>(wr[j]) * x[b * K + j];
    out[b] = s;
  }
}

// Output rows [begin, end) for rows [0, B) of x. bf16 weight rows are short (a 576-wide row is
// 18 cache lines), and reading them one after another as one stream measured faster than four
// rows in lockstep (14 -> 18 GB/s); fp32 rows read best four at a time.
template <int B, typename W, typename Y>
void rows_range(const float* x, const W* w, Y* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  float out[kRows * kMaxBatch];
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    for (int64_t r = begin; r < end; ++r) {
      dot_row<B>(x, w + r * K, out, K);
      for (int b = 0; b < B; ++b) y[b * N + r] = static_cast<Y>(out[b]);
    }
    return;
  }
  int64_t r = begin;
  for (; r + kRows <= end; r += kRows) {
    dot_block<kRows, B>(x, w, out, K, r);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < kRows; ++i) y[b * N + r + i] = static_cast<Y>(out[b * kRows + i]);
  }
  for (; r < end; ++r) {
    dot_block<1, B>(x, w, out, K, r);
    for (int b = 0; b < B; ++b) y[b * N + r] = static_cast<Y>(out[b]);
  }
}

// out[0, Dv) += p * v[0, Dv)
template <typename P>
inline void axpy(float* out, float p, const P* v, int64_t Dv) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= Dv; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(out + d)));
  for (; d < Dv; ++d) out[d] += p * static_cast<float>(v[d]);
}

// One query head over its row's keys in the pools: softmax(q . k_s * scale) . v_s, s < len.
template <typename P>
void attend_head(const float* q, const P* k_pool, const P* v_pool, const int64_t* slots, int64_t len,
                 int64_t G, int64_t g, int64_t D, int64_t Dv, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t s = 0; s < len; ++s) {
    scores[s] = dot(q, k_pool + (slots[s] * G + g) * D, D) * scale;
    top = std::max(top, scores[s]);
  }
  float total = 0.f;
  for (int64_t s = 0; s < len; ++s) total += (scores[s] = std::exp(scores[s] - top));
  std::fill(out, out + Dv, 0.f);
  for (int64_t s = 0; s < len; ++s) axpy(out, scores[s] / total, v_pool + (slots[s] * G + g) * Dv, Dv);
}

#pragma GCC pop_options

template <typename W, typename Y>
void run_pass(const float* x, const W* w, Y* y, int64_t B, int64_t K, int64_t N, int64_t begin,
              int64_t end) {
  switch (B) {
    case 1: return rows_range<1>(x, w, y, K, N, begin, end);
    case 2: return rows_range<2>(x, w, y, K, N, begin, end);
    case 3: return rows_range<3>(x, w, y, K, N, begin, end);
    default: return rows_range<4>(x, w, y, K, N, begin, end);
  }
}

// y_i = x @ w_i.T for several weights that share x (a layer's Q, K and V; SwiGLU's gate and up),
// in one parallel region over all their output rows, so small weights still use every thread.
template <typename W, typename Y>
void gemv_impl(const float* x, const std::vector<const W*>& ws, const std::vector<Y*>& ys,
               const std::vector<int64_t>& ns, int64_t M, int64_t K) {
  std::vector<int64_t> first_block{0};  // block index where each weight starts
  for (int64_t n : ns) first_block.push_back(first_block.back() + (n + kRows - 1) / kRows);
  const int64_t grain = std::max<int64_t>(1, 256 / kRows);  // no thread for fewer than 256 rows
  at::parallel_for(0, first_block.back(), grain, [&](int64_t b0, int64_t b1) {
    // A thread's run of blocks may span weights: take each weight's part of it in turn, and
    // within a part every row of x, kMaxBatch at a time (the part's weight rows are read from
    // memory once, the later passes find them in cache).
    for (size_t i = 0; i < ns.size(); ++i) {
      const int64_t lo = std::max(b0, first_block[i]), hi = std::min(b1, first_block[i + 1]);
      if (lo >= hi) continue;
      const int64_t N = ns[i];
      const int64_t begin = (lo - first_block[i]) * kRows;
      const int64_t end = std::min(N, (hi - first_block[i]) * kRows);
      for (int64_t m = 0; m < M; m += kMaxBatch)
        run_pass(x + m * K, ws[i], ys[i] + m * N, std::min(kMaxBatch, M - m), K, N, begin, end);
    }
  });
}

std::vector<at::Tensor> gemv_many(const at::Tensor& x, at::TensorList ws) {
  TORCH_CHECK(x.dim() == 2, "gemv: x must be (M, K), got ", x.sizes());
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "gemv: x must be a contiguous CPU tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gemv: float32 or bfloat16, got ", dtype);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ys;
  std::vector<int64_t> ns;
  for (const at::Tensor& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "gemv: x has K=", K, ", a weight is ", w.sizes());
    TORCH_CHECK(w.scalar_type() == dtype, "gemv: x and the weights must share a dtype");
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "gemv: weights must be contiguous CPU tensors");
    ys.push_back(at::empty({M, w.size(0)}, x.options()));
    ns.push_back(w.size(0));
  }
  if (dtype == at::kFloat) {
    std::vector<const float*> wp;
    std::vector<float*> yp;
    for (size_t i = 0; i < ws.size(); ++i) {
      wp.push_back(ws[i].data_ptr<float>());
      yp.push_back(ys[i].data_ptr<float>());
    }
    gemv_impl(x.data_ptr<float>(), wp, yp, ns, M, K);
  } else {
    std::vector<const c10::BFloat16*> wp;
    std::vector<c10::BFloat16*> yp;
    for (size_t i = 0; i < ws.size(); ++i) {
      wp.push_back(ws[i].data_ptr<c10::BFloat16>());
      yp.push_back(ys[i].data_ptr<c10::BFloat16>());
    }
    at::Tensor xf = x.to(at::kFloat);  // M x K: tiny next to the weights
    gemv_impl(xf.data_ptr<float>(), wp, yp, ns, M, K);
  }
  return ys;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w) { return gemv_many(x, {w})[0]; }

// Decode attention straight from the paged cache: each row's one query over the keys its slot
// table names, without gathering the history into a padded copy first (the pools are read in
// place; causality is the row's length, since its query is its newest token).
//   q (B, H, D) float32; k_pool (slots, G, D), v_pool (slots, G, Dv) float32 or bfloat16;
//   slots (B, S) int64, the first lengths[b] of row b valid; lengths (B,) int64 >= 1.
//   -> (B, H, Dv) float32. Query head h reads K/V head h / (H / G) (GQA).
template <typename P>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& slots, const at::Tensor& lengths, double scale,
                          at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), G = k_pool.size(1), Dv = v_pool.size(2);
  const int64_t S = slots.size(1), R = H / G;
  const float* qp = q.data_ptr<float>();
  const P* kp = k_pool.data_ptr<P>();
  const P* vp = v_pool.data_ptr<P>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // A short context is a few microseconds of work: waking a second thread costs more.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, S * (D + Dv)));
  at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      attend_head(qp + i * D, kp, vp, sp + b * S, lp[b], G, h / R, D, Dv, static_cast<float>(scale),
                  scores.data(), op + i * Dv);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3,
              "paged_attention: q (B, H, D), pools (slots, G, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: q must be float32");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16),
              "paged_attention: pools float32 or bfloat16, of one dtype");
  TORCH_CHECK(q.size(2) == k_pool.size(2) && k_pool.size(1) == v_pool.size(1) &&
                  k_pool.size(0) == v_pool.size(0) && q.size(1) % k_pool.size(1) == 0,
              "paged_attention: shapes do not agree: q ", q.sizes(), ", k ", k_pool.sizes(), ", v ",
              v_pool.sizes());
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && lengths.dim() == 1 &&
                  lengths.size(0) == q.size(0) && slots.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong,
              "paged_attention: slots (B, S) and lengths (B,) int64");
  for (const at::Tensor* t : {&q, &k_pool, &v_pool, &slots, &lengths})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "paged_attention: contiguous CPU tensors");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= slots.size(1), "paged_attention: row ", b, " length ", lp[b],
                " outside [1, ", slots.size(1), "]");
    for (int64_t s = 0; s < lp[b]; ++s)
      TORCH_CHECK(sp[b * slots.size(1) + s] >= 0 && sp[b * slots.size(1) + s] < k_pool.size(0),
                  "paged_attention: row ", b, " names slot ", sp[b * slots.size(1) + s],
                  " of a pool of ", k_pool.size(0));
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), v_pool.size(2)}, q.options());
  if (k_pool.scalar_type() == at::kFloat)
    paged_attention_impl<float>(q, k_pool, v_pool, slots, lengths, scale, out);
  else
    paged_attention_impl<c10::BFloat16>(q, k_pool, v_pool, slots, lengths, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(egmla, m) {
  m.def("gemv(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_many(Tensor x, Tensor[] ws) -> Tensor[]");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor lengths, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(egmla, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("gemv_many", gemv_many);
  m.impl("paged_attention", paged_attention);
}
