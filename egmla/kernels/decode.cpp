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
//   torch.ops.egmla.gemv_quant(x, [qs, d(, m)]) -> y   x @ w.T for a Q8_0, Q4_0 or Q4_1 weight (below)
//   torch.ops.egmla.paged_attention(q, k_pool, v_pool, slots, lengths, scale)   decode attention
//   torch.ops.egmla.paged_latent_attention(q, c_pool, r_pool, slots, lengths, scale)   MLA's, absorbed
//   torch.ops.egmla.paged_gated_attention(m, q_mu, q_rope, c_pool, ...)   EG-MLA kv's, absorbed
//   torch.ops.egmla.decode_block(x, ...)   a whole Llama block for a decode step (see below)
//   torch.ops.egmla.sparse_mlp(x, ...)     an MLP over only the neurons that fire (see below)
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
#include <memory>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRows = 4;      // weight rows per unit of work split over the threads
constexpr int64_t kMaxBatch = 4;  // x rows per pass over a weight row (2 * kMaxBatch accumulators)

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

// dot over a long row (a neuron's D weights): four independent accumulators, so that the
// FMAs overlap instead of each waiting for the one before (one chain is latency-bound).
template <typename P>
inline float dot_long(const float* q, const P* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 16), load8(k + d + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 24), load8(k + d + 24), a3);
  }
  for (; d + 8 <= D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

#pragma GCC pop_options

// ---- weight rows against a few rows of x: the products of every decode-time linear ---------
// Each output row reads one weight row as one sequential stream. Reading four rows in lockstep
// (four streams at a row's stride) measured slower on this machine, as the rows are short (a
// 576-wide fp32 row is 36 cache lines): for SmolLM2's fp32 shapes, in alternating processes
// while this was written (not kept), about 25 -> 33 GB/s at one row of x and 16 -> 25 GB/s at
// four, a plain sum reading 56 GB/s; decode_speed's records measure the whole step.
//
// bf16 weights are not widened one by one: a 32-bit lane of a bf16 row holds two weights,
// w[2j] in its low half and w[2j+1] in its high half. Shifted left by 16 bits the lane is
// w[2j] as a float; masked to its high half, w[2j+1] (its low bits zero). So against x split
// into its even and odd elements (`split_even_odd`, once per call) a load, a shift, an and and
// two FMAs take 2 x (vector width) weights, where widening took two conversions per vector of
// weights: the same products, in fp32, summed in another order.
//
// Written once as a macro and compiled for AVX2 and for AVX-512 (F, BW, VL), each in its own
// target region so that the AVX2 build holds no AVX-512 instruction; `rows_range` picks by the
// CPU (`cpu_has_avx512`).

// x (B, K) -> xs (B, K): per row its E = (K + 1) / 2 even elements, then its odd ones.
inline void split_even_odd(const float* x, float* xs, int64_t B, int64_t K) {
  const int64_t E = (K + 1) / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < K; ++j) xs[b * K + (j % 2 ? E + j / 2 : j / 2)] = x[b * K + j];
}

#define EGMLA_ROWS(SUFFIX, VEC, WIDTH, SETZERO, LOADU, FMADD, HSUM, LOADI, VECI, SLLI, AND,       \
                   SET1I, CASTPS)                                                                 \
  /* fp32 weights: U vectors of each weight row in flight per row of x */                          \
  template <int B>                                                                                 \
  inline void dot_row_##SUFFIX(const float* x, const float* wr, float* out, int64_t K) {          \
    constexpr int U = B == 1 ? 4 : 2;                                                              \
    VEC acc[U][B];                                                                                 \
    for (int u = 0; u < U; ++u)                                                                    \
      for (int b = 0; b < B; ++b) acc[u][b] = SETZERO();                                           \
    int64_t k = 0;                                                                                 \
    for (; k + U * WIDTH <= K; k += U * WIDTH)                                                     \
      for (int u = 0; u < U; ++u) {                                                                \
        const VEC w = LOADU(wr + k + u * WIDTH);                                                   \
        for (int b = 0; b < B; ++b)                                                                \
          acc[u][b] = FMADD(w, LOADU(x + b * K + k + u * WIDTH), acc[u][b]);                       \
      }                                                                                            \
    for (; k + WIDTH <= K; k += WIDTH)                                                             \
      for (int b = 0; b < B; ++b) acc[0][b] = FMADD(LOADU(wr + k), LOADU(x + b * K + k), acc[0][b]); \
    for (int b = 0; b < B; ++b) {                                                                  \
      for (int u = 1; u < U; ++u) acc[0][b] = _mm##WIDTH##_add(acc[0][b], acc[u][b]);              \
      float s = HSUM(acc[0][b]);                                                                   \
      for (int64_t j = k; j < K; ++j) s += wr[j] * x[b * K + j];                                   \
      out[b] = s;                                                                                  \
    }                                                                                              \
  }                                                                                                \
  /* bf16 weights against xs = split_even_odd(x): 2 * WIDTH weights per load */                    \
  template <int B>                                                                                 \
  inline void dot_row_##SUFFIX(const float* xs, const c10::BFloat16* wr, float* out, int64_t K) { \
    constexpr int U = B <= 2 ? 2 : 1;                                                              \
    const int64_t E = (K + 1) / 2;                                                                 \
    const VECI high = SET1I(static_cast<int>(0xFFFF0000u));                                        \
    VEC acc[2 * U][B];                                                                             \
    for (int u = 0; u < 2 * U; ++u)                                                                \
      for (int b = 0; b < B; ++b) acc[u][b] = SETZERO();                                           \
    int64_t k = 0;                                                                                 \
    for (; k + 2 * U * WIDTH <= K; k += 2 * U * WIDTH)                                             \
      for (int u = 0; u < U; ++u) {                                                                \
        const int64_t at = k + u * 2 * WIDTH;                                                      \
        const VECI v = LOADI(reinterpret_cast<const VECI*>(wr + at));                              \
        const VEC even = CASTPS(SLLI(v, 16)), odd = CASTPS(AND(v, high));                          \
        for (int b = 0; b < B; ++b) {                                                              \
          acc[2 * u][b] = FMADD(even, LOADU(xs + b * K + at / 2), acc[2 * u][b]);                  \
          acc[2 * u + 1][b] = FMADD(odd, LOADU(xs + b * K + E + at / 2), acc[2 * u + 1][b]);       \
        }                                                                                          \
      }                                                                                            \
    for (int b = 0; b < B; ++b) {                                                                  \
      for (int u = 1; u < 2 * U; ++u) acc[0][b] = _mm##WIDTH##_add(acc[0][b], acc[u][b]);          \
      float s = HSUM(acc[0][b]);                                                                   \
      for (int64_t j = k; j < K; ++j)                                                              \
        s += static_cast<float>(wr[j]) * xs[b * K + (j % 2 ? E + j / 2 : j / 2)];                 \
      out[b] = s;                                                                                  \
    }                                                                                              \
  }                                                                                                \
  template <int B, typename W, typename Y>                                                         \
  void rows_range_##SUFFIX(const float* x, const W* w, Y* y, int64_t K, int64_t N, int64_t begin, \
                           int64_t end) {                                                          \
    float out[kMaxBatch];                                                                          \
    for (int64_t r = begin; r < end; ++r) {                                                        \
      dot_row_##SUFFIX<B>(x, w + r * K, out, K);                                                   \
      for (int b = 0; b < B; ++b) y[b * N + r] = static_cast<Y>(out[b]);                           \
    }                                                                                              \
  }

#define _mm8_add _mm256_add_ps
#define _mm16_add _mm512_add_ps

#pragma GCC push_options
#pragma GCC target("avx2,fma")
EGMLA_ROWS(avx2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum,
           _mm256_loadu_si256, __m256i, _mm256_slli_epi32, _mm256_and_si256, _mm256_set1_epi32,
           _mm256_castsi256_ps)
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
EGMLA_ROWS(avx512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
           _mm512_reduce_add_ps, _mm512_loadu_si512, __m512i, _mm512_slli_epi32, _mm512_and_si512,
           _mm512_set1_epi32, _mm512_castsi512_ps)
#pragma GCC pop_options
#undef EGMLA_ROWS
#undef _mm8_add
#undef _mm16_add

// Whether the AVX-512 paths run (here and Q8_0's VNNI): the CPU has AVX-512 F, BW and VL, and
// EGMLA_KERNELS_AVX512 is not "0" (the switch lets a test run the AVX2 paths on such a machine).
bool cpu_has_avx512() {
  static const bool has = [] {
    const char* off = std::getenv("EGMLA_KERNELS_AVX512");
    return !(off && std::string(off) == "0") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

// Output rows [begin, end) for rows [0, B) of x (bf16 weights: xs = split_even_odd(x)). fp32
// weights take the AVX2 rows on every CPU: in an interleaved A/B while this was written (not
// kept), AVX-512's were no faster for fp32 on this machine (AMD) and as fast or faster for bf16.
template <int B, typename W, typename Y>
void rows_range(const float* x, const W* w, Y* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<W, c10::BFloat16>)
    if (cpu_has_avx512()) return rows_range_avx512<B>(x, w, y, K, N, begin, end);
  rows_range_avx2<B>(x, w, y, K, N, begin, end);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// out[0, Dv) += p * v[0, Dv)
template <typename P>
inline void axpy(float* out, float p, const P* v, int64_t Dv) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= Dv; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(out + d)));
  for (; d < Dv; ++d) out[d] += p * static_cast<float>(v[d]);
}

// The horizontal sums of eight vectors, as one vector: {sum(v[0]), ..., sum(v[7])}.
inline __m256 hsum8(const __m256* v) {
  const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 lo4 = _mm256_hadd_ps(a01, a23), hi4 = _mm256_hadd_ps(a45, a67);  // halves per lane
  return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
}

// The horizontal sums of four vectors: {sum(v[0]), ..., sum(v[3])}.
inline __m128 hsum4(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

// exp(x) for x <= 0 (softmax's shifted scores), 8 at a time: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p the degree-6 Taylor polynomial (relative error about 2e-7, near a float's
// rounding); below -87 (where exp underflows float's normal range) it returns 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}

// Each of H rows of scores (n values, `width` apart) replaced by exp(score - its max), with
// that max and the sum of the exponentials written to max[h] and sum[h].
inline void softmax_rows(float* scores, int64_t H, int64_t n, int64_t width, float* max, float* sum) {
  for (int64_t h = 0; h < H; ++h) {
    float* e = scores + h * width;
    __m256 most8 = _mm256_set1_ps(-INFINITY);
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) most8 = _mm256_max_ps(most8, _mm256_loadu_ps(e + s));
    alignas(32) float tops[8];
    _mm256_store_ps(tops, most8);
    float top = *std::max_element(tops, tops + 8);
    for (; s < n; ++s) top = std::max(top, e[s]);
    __m256 sum8 = _mm256_setzero_ps();
    const __m256 top8 = _mm256_set1_ps(top);
    for (s = 0; s + 8 <= n; s += 8) {
      const __m256 x = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(e + s), top8));
      _mm256_storeu_ps(e + s, x);
      sum8 = _mm256_add_ps(sum8, x);
    }
    float total = hsum(sum8);
    for (; s < n; ++s) total += (e[s] = std::exp(e[s] - top));
    max[h] = top;
    sum[h] = total;
  }
}

// Folds one chunk's results (H heads: unnormalized out (Dv each), max, sum) into a running
// merge of earlier chunks of the same row (the split softmax's merge, two at a time).
inline void fold_chunk(float* out, float* max, float* sum, const float* o, const float* mx, const float* sm,
                       int64_t H, int64_t Dv) {
  for (int64_t h = 0; h < H; ++h) {
    const float top = std::max(max[h], mx[h]);
    const float a = std::exp(max[h] - top), c = std::exp(mx[h] - top);
    const __m256 av = _mm256_set1_ps(a), cv = _mm256_set1_ps(c);
    float* acc = out + h * Dv;
    const float* add = o + h * Dv;
    int64_t d = 0;
    for (; d + 8 <= Dv; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(cv, _mm256_loadu_ps(add + d),
                                                _mm256_mul_ps(av, _mm256_loadu_ps(acc + d))));
    for (; d < Dv; ++d) acc[d] = a * acc[d] + c * add[d];
    max[h] = top;
    sum[h] = a * sum[h] + c * sm[h];
  }
}

// Every query head of one row over keys [s0, s1) of the row (n = s1 - s0 <= the scores'
// width): with e_hs = exp(q_h . k_s * scale - m_h), m_h the head's largest score, writes
// out_h = sum_s e_hs v_s (unnormalized), max[h] = m_h and sum[h] = sum_s e_hs, for the split
// softmax of attend_rows. Query head h reads K/V head h / (H / G). The loops run over keys on
// the outside, so each slot's (G, D) row of K and of V is read once, whole and in order;
// scores are taken eight keys at a time (one reduction for eight dot products) and
// exponentiated eight at a time.
template <typename P>
void attend_chunk(const float* q, const P* k_pool, const P* v_pool, const int64_t* slots, int64_t s0,
                  int64_t s1, int64_t H, int64_t G, int64_t D, int64_t Dv, float scale, float* scores,
                  int64_t width, float* out, float* max, float* sum) {
  const int64_t n = s1 - s0, R = H / G;
  slots += s0;
  int64_t s = 0;
  if (D % 8 == 0) {
    for (; s + 8 <= n; s += 8) {
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = q + h * D;
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) {
          const P* k = k_pool + (slots[s + j] * G + h / R) * D;
          acc[j] = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(k));
          for (int64_t d = 8; d < D; d += 8)
            acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(k + d), acc[j]);
        }
        _mm256_storeu_ps(scores + h * width + s, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
      }
    }
  }
  for (; s < n; ++s)
    for (int64_t h = 0; h < H; ++h)
      scores[h * width + s] = dot(q + h * D, k_pool + (slots[s] * G + h / R) * D, D) * scale;
  softmax_rows(scores, H, n, width, max, sum);
  std::fill(out, out + H * Dv, 0.f);
  for (s = 0; s < n; ++s) {
    const P* v = v_pool + slots[s] * G * Dv;
    for (int64_t h = 0; h < H; ++h) axpy(out + h * Dv, scores[h * width + s], v + (h / R) * Dv, Dv);
  }
}

// MLA's absorbed decode over keys [s0, s1) of one row, as attend_chunk for MHA: every query
// head h against the shared latent c_s and the RoPE key of its group (rope head h / (H / Hr)),
//   score_hs = (q_h[:C] . c_s + q_h[C:] . k_rope_s) * scale,   out_h = sum_s e_hs c_s,
// an MQA whose one key/value row (c_s) serves every head. Both products are register-blocked
// so that the FMAs, not the loads, bound them (12 accumulators, in AVX2's 16 registers):
// - scores 3 heads x 4 keys at a time (4 x 3 where H is not a multiple of 3), keys outside and
//   head blocks inside (a few keys' rows serve every head from L1), the heads' queries read
//   from a panel laid out [8-dim step][head][8] (one pointer, constant offsets: H query
//   pointers do not fit in the registers);
// - values 4 heads x 16 latent columns at a time over the chunk's keys, columns outside and
//   head blocks inside (a strip of the latents serves every head from L1).
// The scores wait on memory and the values on nothing (the chunk is in L2 by then): while a
// chunk is computed, the next chunk's cache lines (the `next` keys after it) are asked into L2
// a few at a time, spread evenly over its score and value blocks (asked in a burst, or only
// during the values, most of them arrived too late). At the paper's MLA shapes, 4,096
// scattered keys, batch 1, in interleaved runs while this was written (not kept): 0.67-0.69
// -> 0.48-0.51 ms, paired 0.70-0.75x (EG-MLA latent at d_c 64: 0.26-0.27 -> 0.20-0.21 ms),
// then 0.95x and 0.91x for a vectorized softmax maximum and no transposed probabilities,
// then 0.93-0.95x for attend_rows' in-thread merge and 0.95x for the scale in the panel and
// a head's 4 scores stored as one vector (a chunk's first keys asked for ahead: no change);
// benchmarks/latent_decode.py records the step against its roofline.
constexpr int kValueHeads = 4;

// The keys per score block of SH heads: 12 accumulators (a last, smaller head block fewer).
constexpr int score_keys(int SH) { return std::min(4, 12 / SH); }

// f(std::integral_constant<int, HB>{}, h) for the heads [0, H) in blocks of HB (a last,
// smaller block where HB does not divide H).
template <int HB, typename F>
inline void head_blocks(int64_t H, F&& f) {
  int64_t h = 0;
  for (; h + HB <= H; h += HB) f(std::integral_constant<int, HB>{}, h);
  if constexpr (HB > 1)
    if (h < H) head_blocks<HB - 1>(H - h, [&](auto hb, int64_t i) { f(hb, h + i); });
}

// The next keys' cache lines (their latent rows, then their RoPE rows), asked into L2 a few
// at a time: each pump() asks its share of the lines left, so that `chances` calls spread
// them evenly.
template <typename P>
struct NextLines {
  const char *c_pool, *r_pool;
  const int64_t* slots;  // the next keys'
  int64_t c_row, r_row, c_lines, lines, left, chances, key = 0, line = 0;
  NextLines(const P* c, const P* r, const int64_t* slots, int64_t keys, int64_t C, int64_t rope,
            int64_t chances)
      : c_pool(reinterpret_cast<const char*>(c)), r_pool(reinterpret_cast<const char*>(r)), slots(slots),
        c_row(C * sizeof(P)), r_row(rope * sizeof(P)), c_lines((c_row + 63) / 64),
        lines(c_lines + (r_row + 63) / 64), left(keys * lines), chances(chances) {}
  void pump() {
    if (chances <= 0 || left <= 0) return;
    int64_t take = (left + chances - 1) / chances;
    --chances;
    left -= take;
    for (; take > 0; --take) {
      _mm_prefetch(line < c_lines ? c_pool + slots[key] * c_row + line * 64
                                  : r_pool + slots[key] * r_row + (line - c_lines) * 64,
                   _MM_HINT_T1);
      if (++line == lines) line = 0, ++key;
    }
  }
};

// Scores of HB query heads h .. h + HB - 1 against KB keys (slots[0 .. KB)):
// scores[i * width + j] = (q_{h+i} . [c_j, k_rope_j]) * scale over the blocked dimensions, the
// first C8 of the latent and r8 of the RoPE key. `panel`: the heads' queries times the scale,
// [step][head][8], C8 / 8 steps over the latent, then r8 / 8 over the RoPE key. With 4 keys a
// head's 4 sums are one vector (one reduction, one store).
template <int HB, int KB, typename P>
inline void latent_scores(const float* panel, const P* c_pool, const P* r_pool, const int64_t* slots,
                          int64_t h, int64_t R, int64_t Hr, int64_t C, int64_t C8, int64_t r, int64_t r8,
                          float* scores, int64_t width) {
  __m256 acc[HB * KB];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const float* qs = panel;
  // acc[i][j] += q_i . keys_j over [0, len), the panel's next len / 8 steps
  const auto steps = [&](const P* const* keys, int64_t len) {
    for (int64_t d = 0; d < len; d += 8, qs += HB * 8) {
      __m256 k[KB];
      for (int j = 0; j < KB; ++j) k[j] = load8(keys[j] + d);
      for (int i = 0; i < HB; ++i) {
        const __m256 qv = _mm256_loadu_ps(qs + i * 8);
        for (int j = 0; j < KB; ++j) acc[i * KB + j] = _mm256_fmadd_ps(qv, k[j], acc[i * KB + j]);
      }
    }
  };
  const P* keys[KB];
  for (int j = 0; j < KB; ++j) keys[j] = c_pool + slots[j] * C;
  steps(keys, C8);
  if (h / R == (h + HB - 1) / R) {  // the block's heads read one RoPE key per key
    for (int j = 0; j < KB; ++j) keys[j] = r_pool + (slots[j] * Hr + h / R) * r;
    steps(keys, r8);
  } else {  // each head its group's
    for (int64_t d = 0; d < r8; d += 8, qs += HB * 8)
      for (int i = 0; i < HB; ++i) {
        const __m256 qv = _mm256_loadu_ps(qs + i * 8);
        for (int j = 0; j < KB; ++j)
          acc[i * KB + j] =
              _mm256_fmadd_ps(qv, load8(r_pool + (slots[j] * Hr + (h + i) / R) * r + d), acc[i * KB + j]);
      }
  }
  if constexpr (KB == 4) {  // one head's 4 scores a vector
    for (int i = 0; i < HB; ++i) _mm_storeu_ps(scores + i * width, hsum4(acc + i * KB));
    return;
  }
  alignas(32) float sums[HB * KB + 8];
  int a = 0;
  for (; a + 8 <= HB * KB; a += 8) _mm256_store_ps(sums + a, hsum8(acc + a));
  for (; a + 4 <= HB * KB; a += 4) _mm_store_ps(sums + a, hsum4(acc + a));
  for (; a < HB * KB; ++a) sums[a] = hsum(acc[a]);
  for (int i = 0; i < HB; ++i)
    for (int j = 0; j < KB; ++j) scores[i * width + j] = sums[i * KB + j];
}

// out[i * C + d + c] = sum_k e[i * width + k] c_k[d + c] for heads i < HB and columns c < 8W
// (e: the heads' probabilities), asking for the next lines every 32 keys.
template <int HB, int W, typename P>
inline void latent_values(const float* e, int64_t width, const P* c_pool, const int64_t* slots, int64_t n,
                          int64_t C, int64_t d, float* out, NextLines<P>& next) {
  __m256 acc[HB * W];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; ++k, ++e) {
    if (k % 32 == 0) next.pump();
    const P* c = c_pool + slots[k] * C + d;
    __m256 v[W];
    for (int w = 0; w < W; ++w) v[w] = load8(c + 8 * w);
    for (int i = 0; i < HB; ++i) {
      const __m256 p = _mm256_broadcast_ss(e + i * width);
      for (int w = 0; w < W; ++w) acc[i * W + w] = _mm256_fmadd_ps(p, v[w], acc[i * W + w]);
    }
  }
  for (int i = 0; i < HB; ++i)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + i * C + d + 8 * w, acc[i * W + w]);
}

template <int SH, typename P>
void attend_latent_blocks(const float* q, const P* c_pool, const P* r_pool, const int64_t* slots,
                          int64_t n, int64_t next, int64_t H, int64_t Hr, int64_t C, int64_t r, float scale,
                          float* scores, int64_t width, float* out, float* max, float* sum) {
  const int64_t R = H / Hr, D = C + r, C8 = C - C % 8, r8 = r - r % 8, steps = (C8 + r8) / 8;
  thread_local std::vector<float> panel_memory;
  panel_memory.resize(H * steps * 8);
  float* panel = panel_memory.data();
  head_blocks<SH>(H, [&](auto hb, int64_t h) {  // each block's queries, [step][head][8]
    constexpr int HB = decltype(hb)::value;
    for (int64_t t = 0; t < steps; ++t)
      for (int i = 0; i < HB; ++i) {
        const float* from = q + (h + i) * D + (t * 8 < C8 ? t * 8 : C + t * 8 - C8);
        _mm256_storeu_ps(panel + (h * steps + t * HB + i) * 8, _mm256_mul_ps(_mm256_loadu_ps(from),
                                                                             _mm256_set1_ps(scale)));
      }
  });
  // keys outside, heads inside: KB keys' rows serve every head block from L1
  constexpr int KB = score_keys(SH);
  // how often the next lines are asked for: once per KB keys' scores, once per 32 keys of a
  // value block
  int64_t chances = n / KB + n % KB;
  head_blocks<kValueHeads>(H, [&](auto, int64_t) { chances += (C / 16 + C % 16 / 8) * ((n + 31) / 32); });
  NextLines<P> lines(c_pool, r_pool, slots + n, next, C, Hr * r, chances);
  int64_t s = 0;
  for (; s + KB <= n; s += KB, lines.pump())
    head_blocks<SH>(H, [&](auto hb, int64_t h) {
      latent_scores<decltype(hb)::value, KB>(panel + h * steps * 8, c_pool, r_pool, slots + s, h, R, Hr, C,
                                             C8, r, r8, scores + h * width + s, width);
    });
  for (; s < n; ++s, lines.pump())
    head_blocks<SH>(H, [&](auto hb, int64_t h) {
      latent_scores<decltype(hb)::value, 1>(panel + h * steps * 8, c_pool, r_pool, slots + s, h, R, Hr, C,
                                            C8, r, r8, scores + h * width + s, width);
    });
  if (C8 < C || r8 < r) {  // the dimensions the blocks left
    for (int64_t h = 0; h < H; ++h)
      for (int64_t k = 0; k < n; ++k) {
        const float* qh = q + h * D;
        const P* c = c_pool + slots[k] * C;
        const P* kr = r_pool + (slots[k] * Hr + h / R) * r;
        float t = 0.f;
        for (int64_t d = C8; d < C; ++d) t += qh[d] * static_cast<float>(c[d]);
        for (int64_t d = r8; d < r; ++d) t += qh[C + d] * static_cast<float>(kr[d]);
        scores[h * width + k] += t * scale;
      }
  }
  softmax_rows(scores, H, n, width, max, sum);
  // columns outside, heads inside: a strip of the chunk's latents (n x 16 columns) serves
  // every head block from L1
  int64_t d = 0;
  for (; d + 16 <= C; d += 16)
    head_blocks<kValueHeads>(H, [&](auto hb, int64_t h) {
      latent_values<decltype(hb)::value, 2>(scores + h * width, width, c_pool, slots, n, C, d, out + h * C,
                                            lines);
    });
  for (; d + 8 <= C; d += 8)
    head_blocks<kValueHeads>(H, [&](auto hb, int64_t h) {
      latent_values<decltype(hb)::value, 1>(scores + h * width, width, c_pool, slots, n, C, d, out + h * C,
                                            lines);
    });
  for (int64_t h = 0; h < H; ++h) {  // the columns the blocks left
    float* o = out + h * C;
    std::fill(o + d, o + C, 0.f);
    for (int64_t k = 0; k < n; ++k)
      for (int64_t c = d; c < C; ++c)
        o[c] += scores[h * width + k] * static_cast<float>(c_pool[slots[k] * C + c]);
  }
}

template <typename P>
void attend_latent_chunk(const float* q, const P* c_pool, const P* r_pool, const int64_t* slots,
                         int64_t s0, int64_t s1, int64_t next, int64_t H, int64_t Hr, int64_t C, int64_t r,
                         float scale, float* scores, int64_t width, float* out, float* max, float* sum) {
  if (H % 3 == 0)  // 3-head score blocks (the paper's 12 heads, SmolLM2's 9); else 4 heads
    return attend_latent_blocks<3>(q, c_pool, r_pool, slots + s0, s1 - s0, next, H, Hr, C, r, scale, scores,
                                   width, out, max, sum);
  attend_latent_blocks<4>(q, c_pool, r_pool, slots + s0, s1 - s0, next, H, Hr, C, r, scale, scores, width,
                          out, max, sum);
}


// ---- EG-MLA `kv`'s absorbed decode (see paged_gated_attention for the equations) ------------
// A (row, head)'s keys are taken kGatedTile at a time: their latents gathered into a float tile
// and their gate-table rows into another, padded with zeros to Ep (a multiple of 16) columns,
// so that both per-key products are small dense matrix products, register-blocked with 6 loads
// per 8 FMAs: c^T M for 4 keys x 16 columns at a time (then dotted with the keys' e), and
// A += (w c) e^T for 4 latent rows x 16 columns at a time over the tile's keys. M and the gate
// rows are packed in panels of 16 columns (panel q holds columns 16q..16q+15 of every row, each
// row's 16 contiguous), so that every inner loop reads its operands in order.
constexpr int64_t kGatedTile = 64;

// out[j] = c_j^T M e_j for 4 keys: c their latents (4 x C, row stride C), e their gate rows
// (panels of kGatedTile x 16, key j's at e + 16 j), m M's panels (C x 16 each).
inline void bilinear4(const float* c, const float* e, const float* m, int64_t C, int64_t Ep, float* out) {
  __m256 sv[4];
  for (int j = 0; j < 4; ++j) sv[j] = _mm256_setzero_ps();
  for (int64_t col = 0; col < Ep; col += 16, m += C * 16, e += kGatedTile * 16) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    const float* mk = m;
    for (int64_t k = 0; k < C; ++k, mk += 16) {
      const __m256 m0 = _mm256_loadu_ps(mk), m1 = _mm256_loadu_ps(mk + 8);
      for (int j = 0; j < 4; ++j) {
        const __m256 b = _mm256_broadcast_ss(c + j * C + k);
        acc[2 * j] = _mm256_fmadd_ps(b, m0, acc[2 * j]);
        acc[2 * j + 1] = _mm256_fmadd_ps(b, m1, acc[2 * j + 1]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      sv[j] = _mm256_fmadd_ps(acc[2 * j], _mm256_loadu_ps(e + j * 16), sv[j]);
      sv[j] = _mm256_fmadd_ps(acc[2 * j + 1], _mm256_loadu_ps(e + j * 16 + 8), sv[j]);
    }
  }
  for (int j = 0; j < 4; ++j) out[j] = hsum(sv[j]);
}

// c^T M e for one key (a tile's last keys), the layouts of bilinear4.
inline float bilinear1(const float* c, const float* e, const float* m, int64_t C, int64_t Ep) {
  __m256 sv = _mm256_setzero_ps();
  for (int64_t col = 0; col < Ep; col += 16, m += C * 16, e += kGatedTile * 16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t k = 0; k < C; ++k) {
      const __m256 b = _mm256_broadcast_ss(c + k);
      a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(m + k * 16), a0);
      a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(m + k * 16 + 8), a1);
    }
    sv = _mm256_fmadd_ps(a0, _mm256_loadu_ps(e), sv);
    sv = _mm256_fmadd_ps(a1, _mm256_loadu_ps(e + 8), sv);
  }
  return hsum(sv);
}

// A (C x Ep, row stride Ep) += wc^T e over a tile's n keys: wc the tile's weighted latents
// transposed (C x kGatedTile: row k holds w_j c_j[k] of every key j), e its gate rows in panels.
inline void outer_accumulate(float* A, const float* wc, const float* e, int64_t n, int64_t C, int64_t Ep) {
  const int64_t C4 = C - C % 4;
  for (int64_t col = 0; col < Ep; col += 16) {
    const float* panel = e + col / 16 * kGatedTile * 16;
    for (int64_t k = 0; k < C4; k += 4) {
      __m256 acc[8];
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] = _mm256_loadu_ps(A + (k + i) * Ep + col);
        acc[2 * i + 1] = _mm256_loadu_ps(A + (k + i) * Ep + col + 8);
      }
      for (int64_t j = 0; j < n; ++j) {
        const __m256 e0 = _mm256_loadu_ps(panel + j * 16), e1 = _mm256_loadu_ps(panel + j * 16 + 8);
        for (int i = 0; i < 4; ++i) {
          const __m256 b = _mm256_broadcast_ss(wc + (k + i) * kGatedTile + j);
          acc[2 * i] = _mm256_fmadd_ps(b, e0, acc[2 * i]);
          acc[2 * i + 1] = _mm256_fmadd_ps(b, e1, acc[2 * i + 1]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(A + (k + i) * Ep + col, acc[2 * i]);
        _mm256_storeu_ps(A + (k + i) * Ep + col + 8, acc[2 * i + 1]);
      }
    }
    for (int64_t k = C4; k < C; ++k) {  // the rows the blocks left
      __m256 a0 = _mm256_loadu_ps(A + k * Ep + col), a1 = _mm256_loadu_ps(A + k * Ep + col + 8);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 b = _mm256_set1_ps(wc[k * kGatedTile + j]);
        a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + j * 16), a0);
        a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + j * 16 + 8), a1);
      }
      _mm256_storeu_ps(A + k * Ep + col, a0);
      _mm256_storeu_ps(A + k * Ep + col + 8, a1);
    }
  }
}

// One row's keys as EG-MLA kv's absorbed decode reads them from the pools.
template <typename P, typename T>
struct GatedKeys {
  const P* c_pool;       // (slots, C)
  const P* r_pool;       // (slots, Hr, r)
  const float* stats;    // (slots, W): W = 0 none, 1 [inv_sigma], 2 [mu, inv_sigma]
  const int32_t* ids;    // (slots,): each slot's token id
  const T* table;        // (vocab, E): the gate table
  const int64_t* slots;  // the row's keys in order
  int64_t n, C, Hr, r, W, E, Ep;
  bool residual;         // e extended by a constant 1 (g = 1 + W_UE e)

  float mu(int64_t s) const { return W == 2 ? stats[slots[s] * W] : 0.f; }
  float inv_sigma(int64_t s) const { return W ? stats[slots[s] * W + W - 1] : 1.f; }

  // keys [s0, s0 + len): their gate rows into e, in panels of 16 columns (column k of key j at
  // e[(k / 16) kGatedTile 16 + 16 j + k % 16]), zero-padded to Ep
  void gather_rows(int64_t s0, int64_t len, float* e) const {
    for (int64_t j = 0; j < len; ++j) {
      const T* row = table + static_cast<int64_t>(ids[slots[s0 + j]]) * E;
      const auto at = [&](int64_t k) -> float& { return e[k / 16 * kGatedTile * 16 + j * 16 + k % 16]; };
      for (int64_t k = 0; k < E; ++k) at(k) = static_cast<float>(row[k]);
      for (int64_t k = E; k < Ep; ++k) at(k) = 0.f;
      if (residual) at(E) = 1.f;
    }
  }
};

// One (row, head): the scores of its n keys (written to scores), their softmax, then A (C x E',
// written to a_out) and m (to *m_out). m: the head's M in panels; qmu: the mu coefficient;
// qr: its rotated query's RoPE part, rope its RoPE key's index. Scratch: tiles c (kGatedTile x
// C), e (kGatedTile x Ep, in panels), wc (C x kGatedTile) and A (C x Ep).
template <typename P, typename T>
void gated_head(const GatedKeys<P, T>& keys, const float* m, float qmu, const float* qr, int64_t rope,
                float scale, float* scores, float* ct, float* et, float* wc, float* acc, float* a_out,
                float* m_out) {
  const int64_t n = keys.n, C = keys.C, Ep = keys.Ep, r = keys.r;
  const int64_t* slots = keys.slots;
  for (int64_t s0 = 0; s0 < n; s0 += kGatedTile) {
    const int64_t len = std::min(kGatedTile, n - s0);
    for (int64_t j = 0; j < len; ++j) {
      const P* c = keys.c_pool + slots[s0 + j] * C;
      for (int64_t k = 0; k < C; ++k) ct[j * C + k] = static_cast<float>(c[k]);
    }
    keys.gather_rows(s0, len, et);
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) bilinear4(ct + j * C, et + j * 16, m, C, Ep, scores + s0 + j);
    for (; j < len; ++j) scores[s0 + j] = bilinear1(ct + j * C, et + j * 16, m, C, Ep);
    for (j = 0; j < len; ++j) {
      const int64_t s = s0 + j;
      const float rot = dot(qr, keys.r_pool + (slots[s] * keys.Hr + rope) * r, r);
      scores[s] = (keys.inv_sigma(s) * (scores[s] - keys.mu(s) * qmu) + rot) * scale;
    }
  }
  float top, total;
  softmax_rows(scores, 1, n, n, &top, &total);
  std::fill(acc, acc + C * Ep, 0.f);
  float msum = 0.f;
  for (int64_t s0 = 0; s0 < n; s0 += kGatedTile) {
    const int64_t len = std::min(kGatedTile, n - s0);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t s = s0 + j;
      const float w = scores[s] / total * keys.inv_sigma(s);
      msum += w * keys.mu(s);
      const P* c = keys.c_pool + slots[s] * C;
      for (int64_t k = 0; k < C; ++k) wc[k * kGatedTile + j] = w * static_cast<float>(c[k]);
    }
    keys.gather_rows(s0, len, et);
    outer_accumulate(acc, wc, et, len, C, Ep);
  }
  const int64_t E1 = keys.E + keys.residual;
  for (int64_t k = 0; k < C; ++k) std::copy(acc + k * Ep, acc + k * Ep + E1, a_out + k * E1);
  *m_out = msum;
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
  std::vector<float> split;  // bf16 weights take x's even and odd elements apart (rows_range)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    split.resize(M * K);
    split_even_odd(x, split.data(), M, K);
    x = split.data();
  }
  std::vector<int64_t> first_block{0};  // block index where each weight starts
  for (int64_t n : ns) first_block.push_back(first_block.back() + (n + kRows - 1) / kRows);
  const int64_t grain = std::max<int64_t>(1, 256 / kRows);  // no thread for fewer than 256 rows
  at::parallel_for(0, first_block.back(), grain, [&](int64_t b0, int64_t b1) {
    // A thread's run of blocks may span weights: take each weight's part of it in turn, and
    // within a part tiles of about 64 KiB of weight rows; each tile serves every row of x,
    // kMaxBatch at a time, so it is read from memory once and the later passes find it in L2.
    for (size_t i = 0; i < ns.size(); ++i) {
      const int64_t lo = std::max(b0, first_block[i]), hi = std::min(b1, first_block[i + 1]);
      if (lo >= hi) continue;
      const int64_t N = ns[i];
      const int64_t begin = (lo - first_block[i]) * kRows;
      const int64_t end = std::min(N, (hi - first_block[i]) * kRows);
      const int64_t tile = M <= kMaxBatch ? end - begin
                                          : std::max<int64_t>(1, (1 << 16) / (K * sizeof(W)) / kRows) * kRows;
      for (int64_t t0 = begin; t0 < end; t0 += tile)
        for (int64_t m = 0; m < M; m += kMaxBatch)
          run_pass(x + m * K, ws[i], ys[i] + m * N, std::min(kMaxBatch, M - m), K, N, t0,
                   std::min(end, t0 + tile));
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
// Every row's query heads over the row's keys, split over the threads. A row's keys are cut
// into chunks when there are fewer rows than threads (flash-decoding's split): each chunk's
// softmax is taken on its own, with its maximum and sum, and the chunks are merged after,
//   out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c,   M = max_c m_c,
// so one long sequence still reads its cache on every thread (a thread folds its own chunks
// of a row as it goes, fold_chunk, so that the merge after reads one result per thread: the
// single-threaded merge of every chunk had cost 4% of a 4,096-key latent step). A chunk covers
// every head of its row, so each thread reads whole (G, D) slot rows.
// chunk(b, s0, s1, scores, width, out, max, sum): attend_chunk's work for row b's keys [s0, s1);
// key_floats: the floats a key's rows hold (K and V), which sizes the work per thread.
template <typename Chunk>
void attend_rows(Chunk&& chunk, const int64_t* lp, int64_t B, int64_t H, int64_t Dv, int64_t S,
                 int64_t key_floats, float* op) {
  // Chunks of at most 128 keys (their K and V rows stay in L2 while every head reads them), and
  // at least as many chunks in all as there are threads.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::max((threads + B - 1) / B, (S + 127) / 128);
  const int64_t C = (S + chunks - 1) / chunks;
  // Each thread folds its consecutive chunks of a row into the first of them as it goes, so
  // the merge after reads one partial result per thread and row (the others are left empty).
  std::unique_ptr<float[]> part_out(new float[B * chunks * H * Dv]);
  std::vector<float> part_max(B * chunks * H), part_sum(B * chunks * H);
  // A short context is a few microseconds of work: waking a second thread costs more.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, C * key_floats * H));
  at::parallel_for(0, B * chunks, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(H * C), own(H * Dv + 2 * H);
    int64_t run = -1;  // the chunk holding this thread's merge of the row's chunks so far
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, s0 = (i % chunks) * C, s1 = std::min(lp[b], s0 + C);
      const bool folds = run >= 0 && run / chunks == b;  // into an earlier chunk of its row
      if (s0 >= s1 || folds) {  // nothing of its own for the merge after
        std::fill(&part_max[i * H], &part_max[i * H] + H, -INFINITY);
        std::fill(&part_sum[i * H], &part_sum[i * H] + H, 0.f);
      }
      if (s0 >= s1) continue;  // a row shorter than this chunk's start: nothing to add
      if (!folds) {
        chunk(b, s0, s1, scores.data(), C, part_out.get() + i * H * Dv, &part_max[i * H], &part_sum[i * H]);
        run = i;
        continue;
      }
      float *o = own.data(), *mx = o + H * Dv, *sm = mx + H;
      chunk(b, s0, s1, scores.data(), C, o, mx, sm);
      fold_chunk(part_out.get() + run * H * Dv, &part_max[run * H], &part_sum[run * H], o, mx, sm, H, Dv);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float top = -INFINITY, total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part_max[(b * chunks + c) * H + h]);
      float* out = op + (b * H + h) * Dv;
      std::fill(out, out + Dv, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (b * chunks + c) * H + h;
        if (part_sum[at] == 0.f) continue;
        const float w = std::exp(part_max[at] - top);
        total += w * part_sum[at];
        for (int64_t d = 0; d < Dv; ++d) out[d] += w * part_out[at * Dv + d];
      }
      for (int64_t d = 0; d < Dv; ++d) out[d] /= total;
    }
  }
}

// MHA/GQA decode attention over the paged pools: attend_chunk's rows split over the threads.
template <typename P>
void attend_paged(const float* qp, const P* kp, const P* vp, const int64_t* sp, const int64_t* lp,
                  int64_t B, int64_t H, int64_t G, int64_t D, int64_t Dv, int64_t S, float scale,
                  float* op) {
  attend_rows(
      [&](int64_t b, int64_t s0, int64_t s1, float* scores, int64_t width, float* o, float* mx, float* sm) {
        attend_chunk(qp + b * H * D, kp, vp, sp + b * S, s0, s1, H, G, D, Dv, scale, scores, width, o, mx, sm);
      },
      lp, B, H, Dv, S, D + Dv, op);
}

// The slot tables a decode step reads: every row's length in [1, S], every slot in the pool.
void check_slots(const at::Tensor& slots, const at::Tensor& lengths, int64_t B, int64_t pool_slots,
                 const char* op) {
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && lengths.dim() == 1 && lengths.size(0) == B &&
                  slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              op, ": slots (B, S) and lengths (B,) int64");
  TORCH_CHECK(slots.is_contiguous() && lengths.is_contiguous() && slots.device().is_cpu() &&
                  lengths.device().is_cpu(), op, ": contiguous CPU slot tables");
  const int64_t S = slots.size(1);
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= S, op, ": row ", b, " length ", lp[b], " outside [1, ", S, "]");
    for (int64_t s = 0; s < lp[b]; ++s)
      TORCH_CHECK(sp[b * S + s] >= 0 && sp[b * S + s] < pool_slots, op, ": row ", b, " names slot ",
                  sp[b * S + s], " of a pool of ", pool_slots);
  }
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
  for (const at::Tensor* t : {&q, &k_pool, &v_pool})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "paged_attention: contiguous CPU tensors");
  check_slots(slots, lengths, q.size(0), k_pool.size(0), "paged_attention");
  at::Tensor out = at::empty({q.size(0), q.size(1), v_pool.size(2)}, q.options());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), G = k_pool.size(1), Dv = v_pool.size(2);
  const auto run = [&](auto* pool_type) {
    using P = std::remove_pointer_t<decltype(pool_type)>;
    attend_paged(q.data_ptr<float>(), k_pool.data_ptr<P>(), v_pool.data_ptr<P>(),
                 slots.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), B, H, G, D, Dv, slots.size(1),
                 static_cast<float>(scale), out.data_ptr<float>());
  };
  if (k_pool.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

// MLA's absorbed decode attention straight from the paged cache (see attend_latent_chunk):
//   q (B, H, C + r) float32: each head's absorbed query W_UK^T q_nope, then its rotated q_rope;
//   c_pool (slots, C) and r_pool (slots, r) or (slots, Hr, r), float32 or bfloat16, one dtype;
//   slots (B, S) int64, the first lengths[b] of row b valid; lengths (B,) int64 >= 1.
//   -> (B, H, C) float32: each head's attended latent (W_UV is applied by the caller).
at::Tensor paged_latent_attention(const at::Tensor& q, const at::Tensor& c_pool,
                                  const at::Tensor& r_pool, const at::Tensor& slots,
                                  const at::Tensor& lengths, double scale) {
  const char* op = "paged_latent_attention";
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, op, ": q (B, H, C + r) float32, got ",
              q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(c_pool.dim() == 2 && (r_pool.dim() == 2 || r_pool.dim() == 3), op,
              ": pools c (slots, C) and k_rope (slots, r) or (slots, Hr, r), got ", c_pool.sizes(),
              " and ", r_pool.sizes());
  TORCH_CHECK(c_pool.scalar_type() == r_pool.scalar_type() &&
                  (c_pool.scalar_type() == at::kFloat || c_pool.scalar_type() == at::kBFloat16),
              op, ": pools float32 or bfloat16, of one dtype");
  const int64_t B = q.size(0), H = q.size(1), C = c_pool.size(1);
  const int64_t Hr = r_pool.dim() == 3 ? r_pool.size(1) : 1, r = r_pool.size(-1);
  TORCH_CHECK(q.size(2) == C + r && r_pool.size(0) == c_pool.size(0) && H % Hr == 0, op,
              ": shapes do not agree: q ", q.sizes(), ", c ", c_pool.sizes(), ", k_rope ", r_pool.sizes());
  for (const at::Tensor* t : {&q, &c_pool, &r_pool})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), op, ": contiguous CPU tensors");
  check_slots(slots, lengths, B, c_pool.size(0), op);
  at::Tensor out = at::empty({B, H, C}, q.options());
  const auto run = [&](auto* pool_type) {
    using P = std::remove_pointer_t<decltype(pool_type)>;
    const float* qp = q.data_ptr<float>();
    const P *cp = c_pool.data_ptr<P>(), *rp = r_pool.data_ptr<P>();
    const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lengths.data_ptr<int64_t>();
    const int64_t S = slots.size(1);
    attend_rows(
        [&](int64_t b, int64_t s0, int64_t s1, float* scores, int64_t width, float* o, float* mx, float* sm) {
          attend_latent_chunk(qp + b * H * (C + r), cp, rp, sp + b * S, s0, s1,
                              std::min(lp[b], s1 + (s1 - s0)) - s1, H, Hr, C, r,
                              static_cast<float>(scale), scores, width, o, mx, sm);
        },
        lp, B, H, C, S, C + Hr * r, out.data_ptr<float>());
  };
  if (c_pool.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

// EG-MLA `kv`'s absorbed decode attention straight from the paged cache (docs/attention.md,
// "The absorbed kv computation"). Per query head i and key j, e_j the key's gate-table row
// (table[id_j], with a constant 1 after it when `residual`, g = 1 + W_UE e), mu_j and inv_j its
// cached norm statistics (0 and 1 where the norm caches none):
//   s_ij = (inv_j (c_j^T M_i e_j - mu_j qmu_i) + q^R_i . k^R_j) * scale,   a_ij = softmax_j s_ij
//   A_i = sum_j a_ij inv_j c_j e_j^T   (C x E'),   m_i = sum_j a_ij inv_j mu_j
//   m (B, H, C, E') float32: each head's M_i; q_mu (B, H) float32; q_rope (B, H, r) float32;
//   c_pool (slots, C) and r_pool (slots, r) or (slots, Hr, r), float32 or bfloat16, one dtype;
//   stats_pool (slots, 1 or 2) float32 or None; id_pool (slots,) int32; table (vocab, E)
//   float32 or bfloat16; E' = E + residual; slots, lengths as paged_attention's.
//   -> A (B, H, C, E') and m (B, H), float32. The caller applies W_UV, W_UE and the norm's gain.
// Each (row, head) is one unit of work over the threads: its per-key work is 2 C E' MACs.
std::tuple<at::Tensor, at::Tensor> paged_gated_attention(
    const at::Tensor& m, const at::Tensor& q_mu, const at::Tensor& q_rope, const at::Tensor& c_pool,
    const at::Tensor& r_pool, const std::optional<at::Tensor>& stats_pool, const at::Tensor& id_pool,
    const at::Tensor& table, bool residual, const at::Tensor& slots, const at::Tensor& lengths,
    double scale) {
  const char* op = "paged_gated_attention";
  TORCH_CHECK(m.dim() == 4 && q_mu.dim() == 2 && q_rope.dim() == 3, op,
              ": m (B, H, C, E'), q_mu (B, H), q_rope (B, H, r), got ", m.sizes(), ", ", q_mu.sizes(),
              ", ", q_rope.sizes());
  for (const at::Tensor* t : {&m, &q_mu, &q_rope})
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": m, q_mu and q_rope must be float32");
  TORCH_CHECK(c_pool.dim() == 2 && (r_pool.dim() == 2 || r_pool.dim() == 3) &&
                  c_pool.scalar_type() == r_pool.scalar_type() &&
                  (c_pool.scalar_type() == at::kFloat || c_pool.scalar_type() == at::kBFloat16),
              op, ": pools c (slots, C) and k_rope (slots, [Hr,] r), float32 or bfloat16, of one dtype");
  TORCH_CHECK(table.dim() == 2 && (table.scalar_type() == at::kFloat || table.scalar_type() == at::kBFloat16),
              op, ": table (vocab, E) float32 or bfloat16");
  TORCH_CHECK(id_pool.dim() == 1 && id_pool.scalar_type() == at::kInt, op, ": id_pool (slots,) int32");
  const int64_t B = m.size(0), H = m.size(1), C = m.size(2), E = table.size(1), E1 = E + residual;
  const int64_t pool = c_pool.size(0), Hr = r_pool.dim() == 3 ? r_pool.size(1) : 1, r = r_pool.size(-1);
  const int64_t W = stats_pool.has_value() ? stats_pool->size(1) : 0;
  TORCH_CHECK(m.size(3) == E1 && c_pool.size(1) == C && q_mu.size(0) == B && q_mu.size(1) == H &&
                  q_rope.size(0) == B && q_rope.size(1) == H && q_rope.size(2) == r && H % Hr == 0 &&
                  r_pool.size(0) == pool && id_pool.size(0) == pool,
              op, ": shapes do not agree: m ", m.sizes(), ", q_rope ", q_rope.sizes(), ", c ", c_pool.sizes(),
              ", k_rope ", r_pool.sizes(), ", ids ", id_pool.sizes(), ", table ", table.sizes(),
              ", residual ", residual);
  if (stats_pool.has_value())
    TORCH_CHECK(stats_pool->dim() == 2 && stats_pool->size(0) == pool && (W == 1 || W == 2) &&
                    stats_pool->scalar_type() == at::kFloat && stats_pool->is_contiguous() &&
                    stats_pool->device().is_cpu(),
                op, ": stats_pool (slots, 1 or 2) float32, got ", stats_pool->sizes());
  for (const at::Tensor* t : {&m, &q_mu, &q_rope, &c_pool, &r_pool, &id_pool, &table})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), op, ": contiguous CPU tensors");
  check_slots(slots, lengths, B, pool, op);
  const int64_t S = slots.size(1);
  const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lengths.data_ptr<int64_t>();
  const int32_t* ids = id_pool.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)  // every key's token id names a row of the table
    for (int64_t s = 0; s < lp[b]; ++s) {
      const int32_t id = ids[sp[b * S + s]];
      TORCH_CHECK(id >= 0 && id < table.size(0), op, ": row ", b, " key ", s, " has token id ", id,
                  ", outside the table's ", table.size(0), " rows");
    }
  const int64_t Ep = (E1 + 15) / 16 * 16;
  at::Tensor a_out = at::empty({B, H, C, E1}, m.options()), m_out = at::empty({B, H}, m.options());
  const auto run = [&](auto* pool_type, auto* table_type) {
    using P = std::remove_pointer_t<decltype(pool_type)>;
    using T = std::remove_pointer_t<decltype(table_type)>;
    const float* stats = stats_pool.has_value() ? stats_pool->data_ptr<float>() : nullptr;
    at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> mp(C * Ep), ct(kGatedTile * C), et(kGatedTile * Ep), wc(C * kGatedTile),
          acc(C * Ep), scores(S);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / H, h = i % H;
        const float* mi = m.data_ptr<float>() + i * C * E1;
        for (int64_t k = 0; k < C; ++k)  // M_i in panels of 16 columns, zero-padded to Ep
          for (int64_t col = 0; col < Ep; ++col)
            mp[col / 16 * C * 16 + k * 16 + col % 16] = col < E1 ? mi[k * E1 + col] : 0.f;
        const GatedKeys<P, T> keys{c_pool.data_ptr<P>(), r_pool.data_ptr<P>(), stats, ids,
                                   table.data_ptr<T>(),
                                   sp + b * S, lp[b], C, Hr, r, W, E, Ep, residual};
        gated_head(keys, mp.data(), q_mu.data_ptr<float>()[i], q_rope.data_ptr<float>() + i * r,
                   h / (H / Hr), static_cast<float>(scale), scores.data(), ct.data(), et.data(), wc.data(),
                   acc.data(), a_out.data_ptr<float>() + i * C * E1, m_out.data_ptr<float>() + i);
      }
    });
  };
  const bool bf16_pool = c_pool.scalar_type() == at::kBFloat16;
  const bool bf16_table = table.scalar_type() == at::kBFloat16;
  if (bf16_pool && bf16_table)
    run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  else if (bf16_pool)
    run(static_cast<c10::BFloat16*>(nullptr), static_cast<float*>(nullptr));
  else if (bf16_table)
    run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  else
    run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  return {a_out, m_out};
}

// ---------------------------------------------------------------------------------------------
// A decode step's MLP (a few rows n of its normalized input), dense or over only the neurons
// that fire: PowerInfer's activation locality, with the semantics of egmla/models/sparse_ffn.py.
//
//   activation   0 swiglu  silu(g) u      1 reglu  relu(g) u      (g = w_gate n, u = w_up n)
//                2 drelu   relu(g) relu(u)   3 relu2  relu(u)^2 (no gate)
//   dense        y = w_down h(g, u)
//   sparse       y_b = sum over the neurons i computed of h_bi down_t[i], where neuron i is
//                computed when in some row b its deciding score (|silu(g)| for swiglu, else g;
//                relu2: u) is above `threshold` ("gate" mode: the deciding projection runs for
//                every neuron), or when i < hot or a low-rank predictor s = relu(n W1^T) W2^T +
//                bias marks s_bi > 0 ("predicted" mode: the deciding projection runs only for
//                the neurons computed). With threshold > 0, h_bi is zeroed where row b's score
//                is not above it. Only computed neurons' rows of w_gate, w_up and down_t (down
//                transposed: a neuron's output row is contiguous) are read.

enum Activation : int64_t { kSwiGLU = 0, kReGLU = 1, kDReLU = 2, kReLU2 = 3 };

// h of one neuron from its gate and up pre-activations (relu2: up only).
inline float activate(int64_t act, float g, float u) {
  switch (act) {
    case kSwiGLU: return g / (1.f + std::exp(-g)) * u;
    case kReGLU: return g > 0.f ? g * u : 0.f;
    case kDReLU: return g > 0.f && u > 0.f ? g * u : 0.f;
    default: return u > 0.f ? u * u : 0.f;
  }
}

// The score a threshold applies to: |silu(g)| for swiglu, the pre-activation itself otherwise.
inline float firing_score(int64_t act, float pre) {
  return act == kSwiGLU ? std::fabs(pre / (1.f + std::exp(-pre))) : pre;
}

template <typename W>
void mlp_dense(const float* n, float* y, int64_t B, int64_t D, int64_t F, int64_t act, const W* w_gate,
               const W* w_up, const W* w_down) {
  std::vector<float> gate(act == kReLU2 ? 0 : B * F), up(B * F);
  if (act == kReLU2)
    gemv_impl<W, float>(n, {w_up}, {up.data()}, {F}, B, D);
  else
    gemv_impl<W, float>(n, {w_gate, w_up}, {gate.data(), up.data()}, {F, F}, B, D);
  for (int64_t i = 0; i < B * F; ++i) up[i] = activate(act, act == kReLU2 ? 0.f : gate[i], up[i]);
  gemv_impl<W, float>(up.data(), {w_down}, {y}, {D}, B, F);
}

struct Sparsity {
  float threshold = 0.f;
  int64_t hot = 0;                                             // predicted mode: always computed
  const float *w1 = nullptr, *w2 = nullptr, *bias = nullptr;  // the predictor; none: gate mode
  int64_t rank = 0;
};

// y (B, D) = the sparse MLP of n (B, D); returns how many neurons it computed.
template <typename W>
int64_t mlp_sparse(const float* n, float* y, int64_t B, int64_t D, int64_t F, int64_t act,
                   const W* w_gate, const W* w_up, const W* down_t, const Sparsity& sp) {
  const W* deciding = act == kReLU2 ? w_up : w_gate;
  std::vector<float> pre;  // gate mode: (B, F), the deciding projection of every neuron
  std::vector<uint8_t> fire(F, 0);
  if (sp.w1 == nullptr) {
    pre.resize(B * F);
    gemv_impl<W, float>(n, {deciding}, {pre.data()}, {F}, B, D);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < F; ++i) fire[i] |= firing_score(act, pre[b * F + i]) > sp.threshold;
  } else {
    // The hot block [0, hot) is always computed, so only the cold neurons are scored.
    const int64_t hot = std::min(sp.hot, F), cold = F - hot;
    std::fill(fire.begin(), fire.begin() + hot, uint8_t{1});
    if (cold > 0) {
      std::vector<float> z(B * sp.rank), s(B * cold);
      gemv_impl<float, float>(n, {sp.w1}, {z.data()}, {sp.rank}, B, D);
      for (float& v : z) v = v > 0.f ? v : 0.f;
      gemv_impl<float, float>(z.data(), {sp.w2 + hot * sp.rank}, {s.data()}, {cold}, B, sp.rank);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < cold; ++i)
          fire[hot + i] |= s[b * cold + i] + sp.bias[hot + i] > 0.f;
    }
  }
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < F; ++i)
    if (fire[i]) idx.push_back(i);
  const int64_t A = static_cast<int64_t>(idx.size());
  // Each thread sums its neurons' contributions into its own (B, D) rows; then they are added.
  const int64_t threads = at::get_num_threads();
  std::vector<float> acc(threads * B * D, 0.f);
  at::parallel_for(0, A, 32, [&](int64_t a0, int64_t a1) {
    float* mine = acc.data() + at::get_thread_num() * B * D;
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t i = idx[a];
      for (int64_t b = 0; b < B; ++b) {
        const float* nb = n + b * D;
        const float dec = pre.empty() ? dot_long(nb, deciding + i * D, D) : pre[b * F + i];
        if (sp.threshold > 0.f && !(firing_score(act, dec) > sp.threshold)) continue;
        if (act != kSwiGLU && dec <= 0.f) continue;  // a ReLU of it is 0: h is 0 whatever up is
        const float h = act == kReLU2 ? activate(act, 0.f, dec)
                                      : activate(act, dec, dot_long(nb, w_up + i * D, D));
        if (h != 0.f) axpy(mine + b * D, h, down_t + i * D, D);
      }
    }
  });
  std::fill(y, y + B * D, 0.f);
  for (int64_t t = 0; t < threads; ++t)
    for (int64_t j = 0; j < B * D; ++j) y[j] += acc[t * B * D + j];
  return A;
}

// The MLP's weights and, when sparse, how (what decode_block and sparse_mlp hand mlp_run).
struct MLPArgs {
  int64_t act;
  std::optional<at::Tensor> w_gate;  // none for relu2
  at::Tensor w_up;
  at::Tensor w_down;  // dense; its transpose down_t when sparse
  bool sparse;
  Sparsity sp;  // points into the predictor's tensors, which the caller holds
};

template <typename W>
int64_t mlp_run(const float* n, float* y, int64_t B, int64_t D, const MLPArgs& m) {
  const int64_t F = m.w_up.size(0);
  const W* gate = m.w_gate ? m.w_gate->template data_ptr<W>() : nullptr;
  if (!m.sparse) {
    mlp_dense<W>(n, y, B, D, F, m.act, gate, m.w_up.template data_ptr<W>(),
                 m.w_down.template data_ptr<W>());
    return F;
  }
  return mlp_sparse<W>(n, y, B, D, F, m.act, gate, m.w_up.template data_ptr<W>(),
                       m.w_down.template data_ptr<W>(), m.sp);
}

// Checks the MLP's arguments against x's width D and dtype, and makes MLPArgs of them.
MLPArgs mlp_args(const char* op, int64_t D, at::ScalarType dtype, int64_t activation,
                 const std::optional<at::Tensor>& w_gate, const at::Tensor& w_up,
                 const at::Tensor& w_down, const std::optional<at::Tensor>& down_t, double threshold,
                 int64_t hot, const std::optional<at::Tensor>& p_w1,
                 const std::optional<at::Tensor>& p_w2, const std::optional<at::Tensor>& p_bias) {
  TORCH_CHECK(activation >= kSwiGLU && activation <= kReLU2, op, ": activation ", activation,
              " is not 0 (swiglu), 1 (reglu), 2 (drelu) or 3 (relu2)");
  TORCH_CHECK(w_gate.has_value() == (activation != kReLU2), op, ": ",
              activation == kReLU2 ? "relu2 has no gate" : "a gated MLP needs w_gate");
  TORCH_CHECK(w_up.dim() == 2, op, ": w_up is ", w_up.sizes(), ", expected (F, ", D, ")");
  const int64_t F = w_up.size(0);
  const auto matrix = [&](const at::Tensor& w, int64_t rows, int64_t cols, at::ScalarType t,
                          const char* name) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols, op, ": ", name, " is ",
                w.sizes(), ", expected (", rows, ", ", cols, ")");
    TORCH_CHECK(w.scalar_type() == t && w.is_contiguous() && w.device().is_cpu(), op, ": ", name,
                " must be a contiguous CPU tensor of ", t == dtype ? "x's dtype" : "float32");
  };
  matrix(w_up, F, D, dtype, "w_up");
  if (w_gate) matrix(*w_gate, F, D, dtype, "w_gate");
  const bool sparse = down_t.has_value();
  Sparsity sp;
  if (sparse) {
    matrix(*down_t, F, D, dtype, "down_t");
  } else {
    matrix(w_down, D, F, dtype, "w_down");
  }
  TORCH_CHECK(std::isfinite(threshold) && threshold >= 0, op, ": threshold ", threshold,
              " must be a finite number >= 0");
  TORCH_CHECK(p_w1.has_value() == p_w2.has_value() && p_w1.has_value() == p_bias.has_value(), op,
              ": a predictor is p_w1, p_w2 and p_bias together");
  TORCH_CHECK(sparse || !p_w1.has_value(), op, ": a predictor needs the sparse MLP (down_t)");
  TORCH_CHECK(hot >= 0 && hot <= F, op, ": hot=", hot, " must be in [0, ", F, "]");
  sp.threshold = static_cast<float>(threshold);
  if (p_w1) {
    TORCH_CHECK(p_w1->dim() == 2, op, ": p_w1 is ", p_w1->sizes(), ", expected (rank, ", D, ")");
    sp.rank = p_w1->size(0);
    matrix(*p_w1, sp.rank, D, at::kFloat, "p_w1");
    matrix(*p_w2, F, sp.rank, at::kFloat, "p_w2");
    TORCH_CHECK(p_bias->dim() == 1 && p_bias->size(0) == F && p_bias->scalar_type() == at::kFloat &&
                    p_bias->is_contiguous(), op, ": p_bias must be (", F, ",) float32");
    sp.w1 = p_w1->data_ptr<float>();
    sp.w2 = p_w2->data_ptr<float>();
    sp.bias = p_bias->data_ptr<float>();
    sp.hot = hot;
  }
  return MLPArgs{activation, w_gate, w_up, sparse ? *down_t : w_down, sparse, sp};
}

std::tuple<at::Tensor, int64_t> sparse_mlp(const at::Tensor& x, int64_t activation,
                                           const std::optional<at::Tensor>& w_gate,
                                           const at::Tensor& w_up, const at::Tensor& down_t,
                                           double threshold, int64_t hot,
                                           const std::optional<at::Tensor>& p_w1,
                                           const std::optional<at::Tensor>& p_w2,
                                           const std::optional<at::Tensor>& p_bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "sparse_mlp: x must be a contiguous CPU (B, D) tensor, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "sparse_mlp: float32 or bfloat16, got ",
              dtype);
  const int64_t B = x.size(0), D = x.size(1);
  const std::optional<at::Tensor> sparse{down_t};
  const MLPArgs m = mlp_args("sparse_mlp", D, dtype, activation, w_gate, w_up, down_t, sparse,
                            threshold, hot, p_w1, p_w2, p_bias);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({B, D}, xf.options());
  const int64_t computed =
      dtype == at::kFloat ? mlp_run<float>(xf.data_ptr<float>(), y.data_ptr<float>(), B, D, m)
                          : mlp_run<c10::BFloat16>(xf.data_ptr<float>(), y.data_ptr<float>(), B, D, m);
  return {y.to(dtype), computed};
}

// ---- Q8_0 weights ---------------------------------------------------------------------------
// A weight (N, K) in blocks of 32 values along K, as llama.cpp's Q8_0 stores it: per block one
// float16 scale d and 32 int8 q in [-127, 127], w = d * q; here as two tensors, qs (N, K) int8
// and d (N, K / 32) float16, so a row is two sequential streams. x (M, K) is quantized the same
// way per block (dx = max|x| / 127, q = round(x / dx)), as llama.cpp quantizes activations for
// its Q8_0 products; each block's dot product is then exact in int32 and is scaled by dw * dx
// in float32:
//   torch.ops.egmla.gemv_quant(x, [qs, d]) -> y     x (M, K) float32 or bfloat16, y like x
// With AVX-512 VNNI (and VL) a block is one vpdpbusd; otherwise AVX2's maddubs + madd. The
// unsigned x signed form takes |w| and x * sign(w): |w| <= 127 and |x| <= 127, so the pairs'
// int16 sums (AVX2) cannot saturate.

constexpr int64_t kQBlock = 32;

void quantize_q8_rows(const float* x, int8_t* q, float* d, int32_t* sums, int64_t M, int64_t K) {
  for (int64_t i = 0; i < M * K / kQBlock; ++i) {
    const float* xb = x + i * kQBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    d[i] = scale;
    int32_t sum = 0;
    for (int64_t j = 0; j < kQBlock; ++j) {
      q[i * kQBlock + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      sum += q[i * kQBlock + j];
    }
    sums[i] = sum;
  }
}

// Output rows [begin, end) of y (M rows, N wide) for the quantized x (B <= kMaxBatch rows),
// written once and compiled twice below, for AVX2 and for AVX-512 VNNI (each in its own target
// region, so that the AVX2 build never holds an AVX-512 instruction).
#define EGMLA_Q8_ROWS(NAME, BLOCK_DOT)                                                            \
  template <int B, typename Y>                                                                   \
  void NAME(const int8_t* xq, const float* xd, const int8_t* wq, const c10::Half* wd, Y* y,     \
            int64_t K, int64_t N, int64_t begin, int64_t end) {                                  \
    const int64_t nb = K / kQBlock;                                                              \
    for (int64_t r = begin; r < end; ++r) {                                                      \
      const int8_t* qr = wq + r * K;                                                             \
      const c10::Half* dr = wd + r * nb;                                                         \
      __m256 acc[B];                                                                             \
      for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();                                  \
      for (int64_t j = 0; j < nb; ++j) {                                                         \
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + j * kQBlock)); \
        const float dw = _cvtsh_ss(dr[j].x);                                                     \
        for (int b = 0; b < B; ++b) {                                                            \
          const __m256i xv =                                                                     \
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * K + j * kQBlock));    \
          const __m256 sum = _mm256_cvtepi32_ps(BLOCK_DOT(w, xv));                               \
          acc[b] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dw * xd[b * nb + j]), acc[b]);            \
        }                                                                                        \
      }                                                                                          \
      for (int b = 0; b < B; ++b) y[b * N + r] = static_cast<Y>(hsum(acc[b]));                   \
    }                                                                                            \
  }

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
inline __m256i block_dot_avx2(__m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
EGMLA_Q8_ROWS(q8_rows_avx2, block_dot_avx2)
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
inline __m256i block_dot_vnni(__m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
EGMLA_Q8_ROWS(q8_rows_vnni, block_dot_vnni)
#pragma GCC pop_options
#undef EGMLA_Q8_ROWS

// ---- Q4_0 and Q4_1 weights ------------------------------------------------------------------
// A block of 32 4-bit values q in [0, 15] in 16 bytes, as ggml lays it out: value j in byte j's
// low nibble, value j + 16 in its high nibble; one float16 scale d per block, and for Q4_1 a
// float16 minimum m: w = d q + m (Q4_0: w = d (q - 8), so m = -8 d). Against x's block (dx, xq,
// and the sum of xq, kept from x's quantization):
//   sum_j w_j x_j = d dx sum_j q_j xq_j + m dx sum_j xq_j,
// the first an unsigned-by-signed byte dot product (no sign trick: q >= 0), exact in int32.
//   weights as tensors: qs (N, K / 2) uint8, d (N, K / 32) float16 [, m (N, K / 32) float16]
#define EGMLA_Q4_ROWS(NAME, BLOCK_UDOT)                                                          \
  template <int B, bool MIN, typename Y>                                                         \
  void NAME(const int8_t* xq, const float* xd, const int32_t* xsum, const uint8_t* wq,          \
            const c10::Half* wd, const c10::Half* wm, Y* y, int64_t K, int64_t N, int64_t begin, \
            int64_t end) {                                                                       \
    const int64_t nb = K / kQBlock;                                                              \
    const __m128i nibble = _mm_set1_epi8(0x0F);                                                  \
    for (int64_t r = begin; r < end; ++r) {                                                      \
      const uint8_t* qr = wq + r * (K / 2);                                                      \
      const c10::Half* dr = wd + r * nb;                                                         \
      __m256 acc[B];                                                                             \
      float offset[B];                                                                           \
      for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps(), offset[b] = 0.f;                 \
      for (int64_t j = 0; j < nb; ++j) {                                                         \
        const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + j * 16));        \
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), nibble),         \
                                           _mm_and_si128(p, nibble));                            \
        const float dw = _cvtsh_ss(dr[j].x);                                                     \
        const float mw = MIN ? _cvtsh_ss(wm[r * nb + j].x) : -8.f * dw;                          \
        for (int b = 0; b < B; ++b) {                                                            \
          const __m256i xv =                                                                     \
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * K + j * kQBlock));    \
          const float dx = xd[b * nb + j];                                                       \
          acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(BLOCK_UDOT(w, xv)), _mm256_set1_ps(dw * dx), \
                                   acc[b]);                                                      \
          offset[b] += mw * dx * static_cast<float>(xsum[b * nb + j]);                           \
        }                                                                                        \
      }                                                                                          \
      for (int b = 0; b < B; ++b) y[b * N + r] = static_cast<Y>(hsum(acc[b]) + offset[b]);        \
    }                                                                                            \
  }

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
inline __m256i block_udot_avx2(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
EGMLA_Q4_ROWS(q4_rows_avx2, block_udot_avx2)
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
inline __m256i block_udot_vnni(__m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}
EGMLA_Q4_ROWS(q4_rows_vnni, block_udot_vnni)
#pragma GCC pop_options
#undef EGMLA_Q4_ROWS

template <typename Y>
void q8_rows(bool vnni, int B, const int8_t* xq, const float* xd, const int8_t* wq,
             const c10::Half* wd, Y* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
#define EGMLA_Q8_CASES(NAME)                                                   \
  switch (B) {                                                                 \
    case 1: return NAME<1>(xq, xd, wq, wd, y, K, N, begin, end);               \
    case 2: return NAME<2>(xq, xd, wq, wd, y, K, N, begin, end);               \
    case 3: return NAME<3>(xq, xd, wq, wd, y, K, N, begin, end);               \
    default: return NAME<4>(xq, xd, wq, wd, y, K, N, begin, end);              \
  }
  if (vnni) EGMLA_Q8_CASES(q8_rows_vnni)
  EGMLA_Q8_CASES(q8_rows_avx2)
#undef EGMLA_Q8_CASES
}

template <bool MIN, typename Y>
void q4_rows(bool vnni, int B, const int8_t* xq, const float* xd, const int32_t* xsum,
             const uint8_t* wq, const c10::Half* wd, const c10::Half* wm, Y* y, int64_t K,
             int64_t N, int64_t begin, int64_t end) {
#define EGMLA_Q4_CASES(NAME)                                                            \
  switch (B) {                                                                          \
    case 1: return NAME<1, MIN>(xq, xd, xsum, wq, wd, wm, y, K, N, begin, end);         \
    case 2: return NAME<2, MIN>(xq, xd, xsum, wq, wd, wm, y, K, N, begin, end);         \
    case 3: return NAME<3, MIN>(xq, xd, xsum, wq, wd, wm, y, K, N, begin, end);         \
    default: return NAME<4, MIN>(xq, xd, xsum, wq, wd, wm, y, K, N, begin, end);        \
  }
  if (vnni) EGMLA_Q4_CASES(q4_rows_vnni)
  EGMLA_Q4_CASES(q4_rows_avx2)
#undef EGMLA_Q4_CASES
}

// Whether the VNNI path runs: the AVX-512 paths run (cpu_has_avx512) and the CPU has VNNI.
bool cpu_has_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

enum QFormat { kQ8_0, kQ4_0, kQ4_1 };

struct QMat {  // a block-quantized weight (N, K): its values, scales and (Q4_1) minima
  QFormat format;
  const void* q;  // Q8_0: (N, K) int8; Q4: (N, K / 2) uint8
  const c10::Half* d;  // (N, K / 32)
  const c10::Half* m;  // (N, K / 32), Q4_1 only
};

// y_i = x @ w_i.T (float32, M rows) for several block-quantized weights sharing x: x quantized
// once, then every weight's output rows in one parallel region (as gemv_impl does for float
// weights), each weight in its own format.
void gemv_quant_many(const float* x, const std::vector<QMat>& ws, const std::vector<float*>& ys,
                     const std::vector<int64_t>& ns, int64_t M, int64_t K) {
  const int64_t nb = K / kQBlock;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb);
  std::vector<int32_t> xsum(M * nb);
  quantize_q8_rows(x, xq.data(), xd.data(), xsum.data(), M, K);
  std::vector<int64_t> first{0};  // row where each weight starts, over all of them
  for (int64_t n : ns) first.push_back(first.back() + n);
  const bool vnni = cpu_has_vnni();
  at::parallel_for(0, first.back(), 64, [&](int64_t r0, int64_t r1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(r0, first[i]), hi = std::min(r1, first[i + 1]);
      if (lo >= hi) continue;
      const QMat& w = ws[i];
      for (int64_t m = 0; m < M; m += kMaxBatch) {
        const int B = static_cast<int>(std::min(kMaxBatch, M - m));
        const int8_t* xqm = xq.data() + m * K;
        const float* xdm = xd.data() + m * nb;
        float* y = ys[i] + m * ns[i];
        if (w.format == kQ8_0)
          q8_rows(vnni, B, xqm, xdm, static_cast<const int8_t*>(w.q), w.d, y, K, ns[i],
                  lo - first[i], hi - first[i]);
        else if (w.format == kQ4_0)
          q4_rows<false>(vnni, B, xqm, xdm, xsum.data() + m * nb, static_cast<const uint8_t*>(w.q),
                         w.d, w.m, y, K, ns[i], lo - first[i], hi - first[i]);
        else
          q4_rows<true>(vnni, B, xqm, xdm, xsum.data() + m * nb, static_cast<const uint8_t*>(w.q),
                        w.d, w.m, y, K, ns[i], lo - first[i], hi - first[i]);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// A whole pre-norm Llama block for a decode step (one new token per row) in one call:
//
//   n1  = rms_norm(x) * attn_norm;    q, k, v = rope(wq n1), rope(wk n1), wv n1
//   h   = x + wo . softmax(q . K * scale) V      (K, V: the row's keys in the pools, k and v
//                                                 written at the row's new slot first)
//   n2  = rms_norm(h) * mlp_norm;     out = h + mlp(n2)   (mlp_run: dense or sparse, any activation)
//
// The module path's arithmetic (same kernels for the products and the attention) without its
// ~40 operator calls per layer, each of which costs more than its work at one token. The
// activations stay float32 from input to output (bf16 weights widen in registers); a bf16
// block rounds its residual stream to bf16 after each add, where the module path rounds it.

template <typename W>
void rms_norm_rows(const float* x, const W* w, float* y, int64_t B, int64_t D, float eps) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * D;
    float* yr = y + b * D;
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * r * static_cast<float>(w[d]);
  }
}

// Rotary embedding in place, half-split layout: pairs (i, i + Dh/2) share cos/sin[b] (B, Dh).
void rope_rows(float* t, const float* cos, const float* sin, int64_t B, int64_t heads, int64_t Dh) {
  const int64_t half = Dh / 2;
  for (int64_t b = 0; b < B; ++b) {
    const float* c = cos + b * Dh;
    const float* s = sin + b * Dh;
    for (int64_t h = 0; h < heads; ++h) {
      float* r = t + (b * heads + h) * Dh;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = r[i], x2 = r[i + half];
        r[i] = x1 * c[i] - x2 * s[i];
        r[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

template <typename P>
void write_rows(P* pool, const int64_t* new_slots, const float* src, int64_t B, int64_t row) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < row; ++i) pool[new_slots[b] * row + i] = static_cast<P>(src[b * row + i]);
}

// x += delta, rounded to bf16 when the block's dtype is bf16.
void add_residual(float* x, const float* delta, int64_t n, bool to_bf16) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] + delta[i];
    x[i] = to_bf16 ? static_cast<float>(c10::BFloat16(v)) : v;
  }
}

struct BlockShape {
  int64_t B, D, H, G, Dh, S;
};

// The block's sequence, its products supplied by the caller: qkv(normed, q, k, v), wo(att, out)
// and mlp(normed, out) -> the MLP neurons computed (float or Q8_0 weights, dense or sparse).
template <typename N, typename P, typename QKV, typename WO, typename MLP>
int64_t decode_block_impl(float* x, bool to_bf16, const BlockShape& n, const N* attn_norm,
                          float attn_eps, QKV&& qkv, WO&& wo, const N* mlp_norm, float mlp_eps,
                          MLP&& mlp, const float* cos, const float* sin, P* k_pool, P* v_pool,
                          const int64_t* new_slots, const int64_t* slots, const int64_t* lengths,
                          float scale) {
  const int64_t B = n.B, D = n.D, HD = n.H * n.Dh, GD = n.G * n.Dh;
  std::vector<float> normed(B * D), q(B * HD), k(B * GD), v(B * GD), att(B * HD), out(B * D);
  rms_norm_rows(x, attn_norm, normed.data(), B, D, attn_eps);
  qkv(normed.data(), q.data(), k.data(), v.data());
  rope_rows(q.data(), cos, sin, B, n.H, n.Dh);
  rope_rows(k.data(), cos, sin, B, n.G, n.Dh);
  write_rows(k_pool, new_slots, k.data(), B, GD);
  write_rows(v_pool, new_slots, v.data(), B, GD);
  attend_paged(q.data(), k_pool, v_pool, slots, lengths, B, n.H, n.G, n.Dh, n.Dh, n.S, scale, att.data());
  wo(att.data(), out.data());
  add_residual(x, out.data(), B * D, to_bf16);
  rms_norm_rows(x, mlp_norm, normed.data(), B, D, mlp_eps);
  const int64_t computed = mlp(normed.data(), out.data());
  add_residual(x, out.data(), B * D, to_bf16);
  return computed;
}

void check_matrix(const at::Tensor& w, int64_t rows, int64_t cols, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols, "decode_block: ", name, " is ",
              w.sizes(), ", expected (", rows, ", ", cols, ")");
  TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous() && w.device().is_cpu(), "decode_block: ",
              name, " must be a contiguous CPU tensor of x's dtype");
}

// Checks a decode step's x, pools, RoPE tables and slots against each other and the query
// rows of wq (wq_rows), and returns the step's shape; `op` names the caller in messages.
BlockShape check_block_step(const char* op, const at::Tensor& x, int64_t wq_rows,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& new_slots,
                            const at::Tensor& slots, const at::Tensor& lengths) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous CPU (B, D) tensor, got ", x.sizes());
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() &&
                  k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16) &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.device().is_cpu() &&
                  v_pool.device().is_cpu(),
              op, ": pools (slots, G, Dh) of one shape, float32 or bfloat16, got ", k_pool.sizes(),
              " and ", v_pool.sizes());
  BlockShape n{x.size(0), x.size(1), 0, k_pool.size(1), k_pool.size(2), slots.size(1)};
  TORCH_CHECK(n.Dh % 2 == 0 && wq_rows % n.Dh == 0 && (wq_rows / n.Dh) % n.G == 0, op, ": wq's ",
              wq_rows, " rows are not a whole number of heads of ", n.Dh, " grouped over ", n.G,
              " K/V heads");
  n.H = wq_rows / n.Dh;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n.B && t->size(1) == n.Dh &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(),
                op, ": cos and sin (B, Dh) float32, got ", t->sizes());
  check_slots(slots, lengths, n.B, k_pool.size(0), op);
  TORCH_CHECK(new_slots.dim() == 1 && new_slots.size(0) == n.B &&
                  new_slots.scalar_type() == at::kLong && new_slots.is_contiguous(),
              op, ": new_slots (B,) int64");
  const int64_t* ns = new_slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < n.B; ++b)  // each row's query is its newest key
    TORCH_CHECK(slots.data_ptr<int64_t>()[b * n.S + lp[b] - 1] == ns[b], op, ": row ", b,
                "'s new slot ", ns[b], " is not its last key's");
  return n;
}

std::tuple<at::Tensor, int64_t> decode_block(
    const at::Tensor& x, const at::Tensor& attn_norm, double attn_eps, const at::Tensor& wq,
    const at::Tensor& wk, const at::Tensor& wv, const at::Tensor& wo, const at::Tensor& mlp_norm,
    double mlp_eps, int64_t activation, const std::optional<at::Tensor>& w_gate,
    const at::Tensor& w_up, const at::Tensor& w_down, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& new_slots, const at::Tensor& slots,
    const at::Tensor& lengths, double scale, const std::optional<at::Tensor>& down_t,
    double threshold, int64_t hot, const std::optional<at::Tensor>& p_w1,
    const std::optional<at::Tensor>& p_w2, const std::optional<at::Tensor>& p_bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_block: float32 or bfloat16, got ",
              dtype);
  TORCH_CHECK(wq.dim() == 2, "decode_block: wq is ", wq.sizes());
  const BlockShape n = check_block_step("decode_block", x, wq.size(0), cos, sin, k_pool, v_pool,
                                        new_slots, slots, lengths);
  check_matrix(wq, n.H * n.Dh, n.D, dtype, "wq");
  check_matrix(wk, n.G * n.Dh, n.D, dtype, "wk");
  check_matrix(wv, n.G * n.Dh, n.D, dtype, "wv");
  check_matrix(wo, n.D, n.H * n.Dh, dtype, "wo");
  const MLPArgs mlp = mlp_args("decode_block", n.D, dtype, activation, w_gate, w_up, w_down, down_t,
                               threshold, hot, p_w1, p_w2, p_bias);
  for (const at::Tensor* w : {&attn_norm, &mlp_norm})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == n.D && w->scalar_type() == dtype && w->is_contiguous(),
                "decode_block: norm weights (D,) of x's dtype, got ", w->sizes());
  const int64_t* ns = new_slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();

  at::Tensor h = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);  // one copy, ours to write
  int64_t computed = 0;
  const auto run = [&](auto* weight_type, auto* pool_type) {
    using W = std::remove_pointer_t<decltype(weight_type)>;
    using P = std::remove_pointer_t<decltype(pool_type)>;
    const int64_t B = n.B, D = n.D, HD = n.H * n.Dh, GD = n.G * n.Dh;
    const W *q = wq.data_ptr<W>(), *k = wk.data_ptr<W>(), *v = wv.data_ptr<W>(), *o = wo.data_ptr<W>();
    computed = decode_block_impl(
        h.data_ptr<float>(), dtype == at::kBFloat16, n, attn_norm.data_ptr<W>(),
        static_cast<float>(attn_eps),
        [&](const float* in, float* yq, float* yk, float* yv) {
          gemv_impl<W, float>(in, {q, k, v}, {yq, yk, yv}, {HD, GD, GD}, B, D);
        },
        [&](const float* in, float* y) { gemv_impl<W, float>(in, {o}, {y}, {D}, B, HD); },
        mlp_norm.data_ptr<W>(), static_cast<float>(mlp_eps),
        [&](const float* in, float* y) { return mlp_run<W>(in, y, B, D, mlp); },
        cos.data_ptr<float>(), sin.data_ptr<float>(), k_pool.data_ptr<P>(), v_pool.data_ptr<P>(), ns,
        slots.data_ptr<int64_t>(), lp, static_cast<float>(scale));
  };
  const bool bf16_pool = k_pool.scalar_type() == at::kBFloat16;
  if (dtype == at::kFloat)
    bf16_pool ? run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr))
              : run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else
    bf16_pool ? run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr))
              : run(static_cast<c10::BFloat16*>(nullptr), static_cast<float*>(nullptr));
  return {h.to(dtype), computed};
}


// A block-quantized weight's tensors checked against its (rows, cols) and made a QMat: [qs, d]
// with qs int8 (rows, cols) is Q8_0; [qs, d] with qs uint8 (rows, cols / 2), Q4_0; [qs, d, m]
// with qs uint8, Q4_1; d and m float16 (rows, cols / 32).
QMat quant_mat(const char* op, const char* name, at::TensorList w, int64_t rows, int64_t cols) {
  TORCH_CHECK(w.size() == 2 || w.size() == 3, op, ": ", name, " must be [qs, d] or [qs, d, m], got ",
              w.size(), " tensors");
  TORCH_CHECK(cols % kQBlock == 0, op, ": ", name, "'s input width ", cols, " is not a multiple of ",
              kQBlock);
  const at::Tensor& qs = w[0];
  const bool q8 = qs.scalar_type() == at::kChar;
  TORCH_CHECK((q8 && w.size() == 2) || qs.scalar_type() == at::kByte, op, ": ", name,
              "'s qs must be int8 (Q8_0: [qs, d]) or uint8 (Q4_0: [qs, d]; Q4_1: [qs, d, m]), got ",
              qs.scalar_type(), " with ", w.size(), " tensors");
  const int64_t width = q8 ? cols : cols / 2;
  TORCH_CHECK(qs.dim() == 2 && qs.size(0) == rows && qs.size(1) == width && qs.is_contiguous() &&
                  qs.device().is_cpu(),
              op, ": ", name, "'s qs must be a contiguous CPU (", rows, ", ", width, "), got ", qs.sizes());
  for (size_t i = 1; i < w.size(); ++i)
    TORCH_CHECK(w[i].dim() == 2 && w[i].size(0) == rows && w[i].size(1) == cols / kQBlock &&
                    w[i].scalar_type() == at::kHalf && w[i].is_contiguous() && w[i].device().is_cpu(),
                op, ": ", name, "'s ", i == 1 ? "d" : "m", " must be contiguous float16 (", rows, ", ",
                cols / kQBlock, "), got ", w[i].sizes(), " ", w[i].scalar_type());
  return {q8 ? kQ8_0 : (w.size() == 2 ? kQ4_0 : kQ4_1), qs.data_ptr(), w[1].data_ptr<c10::Half>(),
          w.size() == 3 ? w[2].data_ptr<c10::Half>() : nullptr};
}

// x @ w.T for a block-quantized weight w (quant_mat's forms), x (M, K) float32 or bfloat16.
at::Tensor gemv_quant(const at::Tensor& x, at::TensorList w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "gemv_quant: x must be a contiguous (M, K) CPU tensor, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gemv_quant: x float32 or bfloat16, got ",
              dtype);
  TORCH_CHECK(!w.empty() && w[0].dim() == 2, "gemv_quant: the weight must be [qs, d] or [qs, d, m]");
  const int64_t M = x.size(0), K = x.size(1), N = w[0].size(0);
  TORCH_CHECK(K % kQBlock == 0, "gemv_quant: K=", K, " is not a multiple of ", kQBlock);
  const QMat mat = quant_mat("gemv_quant", "the weight", w, N, K);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, xf.options());
  gemv_quant_many(xf.data_ptr<float>(), {mat}, {y.data_ptr<float>()}, {N}, M, K);
  return y.to(dtype);
}

// decode_block with block-quantized weights (float32 activations, float32 norms): each weight
// in one of quant_mat's forms, formats mixed as they come; the MLP dense (w_gate empty for relu2).
std::tuple<at::Tensor, int64_t> decode_block_quant(
    const at::Tensor& x, const at::Tensor& attn_norm, double attn_eps, at::TensorList wq,
    at::TensorList wk, at::TensorList wv, at::TensorList wo, const at::Tensor& mlp_norm,
    double mlp_eps, int64_t activation, at::TensorList w_gate, at::TensorList w_up,
    at::TensorList w_down, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
    at::Tensor& v_pool, const at::Tensor& new_slots, const at::Tensor& slots,
    const at::Tensor& lengths, double scale) {
  const char* op = "decode_block_quant";
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x float32, got ", x.scalar_type());
  TORCH_CHECK(!wq.empty() && wq[0].dim() == 2, op, ": wq must be [qs, d] or [qs, d, m]");
  const BlockShape n = check_block_step(op, x, wq[0].size(0), cos, sin, k_pool, v_pool, new_slots,
                                        slots, lengths);
  const int64_t B = n.B, D = n.D, HD = n.H * n.Dh, GD = n.G * n.Dh;
  const QMat q = quant_mat(op, "wq", wq, HD, D), k = quant_mat(op, "wk", wk, GD, D),
              v = quant_mat(op, "wv", wv, GD, D), o = quant_mat(op, "wo", wo, D, HD);
  TORCH_CHECK(activation >= kSwiGLU && activation <= kReLU2, op, ": activation ", activation,
              " is not 0..3");
  TORCH_CHECK(w_gate.empty() == (activation == kReLU2), op, ": ",
              activation == kReLU2 ? "relu2 has no gate" : "a gated MLP needs w_gate");
  TORCH_CHECK(!w_up.empty() && w_up[0].dim() == 2, op, ": w_up must be [qs, d] or [qs, d, m]");
  const int64_t F = w_up[0].size(0);
  const QMat up = quant_mat(op, "w_up", w_up, F, D), down = quant_mat(op, "w_down", w_down, D, F);
  const std::optional<QMat> gate =
      w_gate.empty() ? std::nullopt : std::optional<QMat>(quant_mat(op, "w_gate", w_gate, F, D));
  for (const at::Tensor* w : {&attn_norm, &mlp_norm})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == D && w->scalar_type() == at::kFloat && w->is_contiguous(),
                op, ": norm weights (D,) float32, got ", w->sizes());

  at::Tensor h = x.clone();  // ours to write
  const auto mlp = [&](const float* in, float* y) {
    std::vector<float> g(gate ? B * F : 0), u(B * F);
    if (gate)
      gemv_quant_many(in, {*gate, up}, {g.data(), u.data()}, {F, F}, B, D);
    else
      gemv_quant_many(in, {up}, {u.data()}, {F}, B, D);
    for (int64_t i = 0; i < B * F; ++i) u[i] = activate(activation, gate ? g[i] : 0.f, u[i]);
    gemv_quant_many(u.data(), {down}, {y}, {D}, B, F);
    return F;
  };
  const auto run = [&](auto* pool_type) {
    using P = std::remove_pointer_t<decltype(pool_type)>;
    return decode_block_impl(
        h.data_ptr<float>(), false, n, attn_norm.data_ptr<float>(), static_cast<float>(attn_eps),
        [&](const float* in, float* yq, float* yk, float* yv) {
          gemv_quant_many(in, {q, k, v}, {yq, yk, yv}, {HD, GD, GD}, B, D);
        },
        [&](const float* in, float* y) { gemv_quant_many(in, {o}, {y}, {D}, B, HD); },
        mlp_norm.data_ptr<float>(), static_cast<float>(mlp_eps), mlp, cos.data_ptr<float>(),
        sin.data_ptr<float>(), k_pool.data_ptr<P>(), v_pool.data_ptr<P>(),
        new_slots.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
        static_cast<float>(scale));
  };
  const int64_t computed = k_pool.scalar_type() == at::kBFloat16
                               ? run(static_cast<c10::BFloat16*>(nullptr))
                               : run(static_cast<float*>(nullptr));
  return {h, computed};
}

}  // namespace

TORCH_LIBRARY(egmla, m) {
  m.def("gemv(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_many(Tensor x, Tensor[] ws) -> Tensor[]");
  m.def("gemv_quant(Tensor x, Tensor[] w) -> Tensor");
  m.def("paged_latent_attention(Tensor q, Tensor c_pool, Tensor r_pool, Tensor slots, Tensor lengths, "
        "float scale) -> Tensor");
  m.def("paged_gated_attention(Tensor m, Tensor q_mu, Tensor q_rope, Tensor c_pool, Tensor r_pool, "
        "Tensor? stats_pool, Tensor id_pool, Tensor table, bool residual, Tensor slots, Tensor lengths, "
        "float scale) -> (Tensor, Tensor)");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor lengths, "
        "float scale) -> Tensor");
  m.def("decode_block(Tensor x, Tensor attn_norm, float attn_eps, Tensor wq, Tensor wk, Tensor wv, "
        "Tensor wo, Tensor mlp_norm, float mlp_eps, int activation, Tensor? w_gate, Tensor w_up, "
        "Tensor w_down, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor new_slots, Tensor slots, Tensor lengths, float scale, Tensor? down_t=None, "
        "float threshold=0., int hot=0, Tensor? p_w1=None, Tensor? p_w2=None, "
        "Tensor? p_bias=None) -> (Tensor, int)");
  m.def("decode_block_quant(Tensor x, Tensor attn_norm, float attn_eps, Tensor[] wq, Tensor[] wk, "
        "Tensor[] wv, Tensor[] wo, Tensor mlp_norm, float mlp_eps, int activation, Tensor[] w_gate, "
        "Tensor[] w_up, Tensor[] w_down, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
        "Tensor(b!) v_pool, Tensor new_slots, Tensor slots, Tensor lengths, float scale) -> (Tensor, int)");
  m.def("sparse_mlp(Tensor x, int activation, Tensor? w_gate, Tensor w_up, Tensor down_t, "
        "float threshold=0., int hot=0, Tensor? p_w1=None, Tensor? p_w2=None, "
        "Tensor? p_bias=None) -> (Tensor, int)");
}

TORCH_LIBRARY_IMPL(egmla, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("gemv_many", gemv_many);
  m.impl("gemv_quant", gemv_quant);
  m.impl("paged_attention", paged_attention);
  m.impl("paged_latent_attention", paged_latent_attention);
  m.impl("paged_gated_attention", paged_gated_attention);
  m.impl("decode_block", decode_block);
  m.impl("decode_block_quant", decode_block_quant);
  m.impl("sparse_mlp", sparse_mlp);
}
