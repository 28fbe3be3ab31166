// kiln's CPU kernels: a linear layer over packed 16- or 32-bit weights and paged attention, both
// batch-invariant, and the structured-output token mask. Every output element is computed by the same sequence of float32 operations whatever
// the number of rows in the call, how rows are tiled, or how work is split across threads:
//  - linear: y[m, n] = bias[n] + sum over k of x[m, k] * w[n, k], accumulated by one FMA chain in k order;
//  - attention: a query row's online softmax walks its context in KV-cache blocks from position 0.
// Built once per machine by kiln/ops/cpu/native.py; registered as torch ops under `kiln_cpu`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kiln's CPU kernels need AVX2, FMA and F16C"
#endif

namespace {

constexpr int64_t kBlock = 16;  // packed weight columns per block: two 8-float vectors

// Eight weights widened to float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const c10::Half* p) { return static_cast<float>(*p); }
inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }

// ---------------------------------------------------------------------------------------------------
// linear: x [M, K] float32 (rows may be strided), w packed [NB, K, 16] (column n of block b is
// w[b, :, n % 16], zero past N), bias [N] float32 or none -> y [M, N] float32.

// Weight bytes to bring into L2 while a tile computes: the next chunk's, spread over the tile's k loop.
struct Prefetch {
  const char* base = nullptr;
  int64_t bytes = 0;
};

// MR rows by NB blocks: MR * NB * 2 accumulators, each one column vector's FMA chain over k.
template <typename W, int MR, int NB>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t n0, int64_t N, Prefetch pf) {
  const int64_t lines = (pf.bytes + 63) / 64;
  int64_t issued = 0, due = 0;  // lines prefetched; lines due by this k, times K
  __m256 acc[MR][NB * 2];
#pragma GCC unroll 24
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB * 2; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (due += lines; due >= K; due -= K) _mm_prefetch(pf.base + 64 * issued++, _MM_HINT_T1);
    __m256 wv[NB * 2];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const W* p = w + (b * K + k) * kBlock;
      wv[2 * b] = load8(p);
      wv[2 * b + 1] = load8(p + 8);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB * 2; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  // Spill the tile through a buffer: indexing acc with a run-time bound would keep it in memory.
  alignas(32) float out[MR][NB * kBlock];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB * 2; ++j) _mm256_store_ps(&out[m][j * 8], acc[m][j]);
  const int64_t width = std::min<int64_t>(NB * kBlock, N - n0);
  for (int m = 0; m < MR; ++m) {
    float* dst = y + m * ldy + n0;
    if (bias)
      for (int64_t i = 0; i < width; ++i) dst[i] = out[m][i] + bias[n0 + i];
    else
      for (int64_t i = 0; i < width; ++i) dst[i] = out[m][i];
  }
}

// Blocks [b0, b1) for rows [0, M): the tile shape follows the rows left, never the arithmetic.
template <typename W, int MR>
inline void rows(const float* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t N, int64_t b0, int64_t b1, Prefetch pf) {
  constexpr int NB = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  // Each tile prefetches its share of pf, in proportion to its blocks.
  auto share = [&](int64_t b, int64_t nb) {
    const int64_t lo = pf.bytes * (b - b0) / (b1 - b0), hi = pf.bytes * (b - b0 + nb) / (b1 - b0);
    return Prefetch{pf.base + lo, hi - lo};
  };
  int64_t b = b0;
  for (; b + NB <= b1; b += NB)
    tile<W, MR, NB>(x, ldx, w + b * K * kBlock, K, bias, y, ldy, b * kBlock, N, share(b, NB));
  for (; b < b1; ++b) tile<W, MR, 1>(x, ldx, w + b * K * kBlock, K, bias, y, ldy, b * kBlock, N, share(b, 1));
}

template <typename W>
void linear_impl(const float* x, int64_t ldx, const W* w, int64_t K, int64_t NB, const float* bias,
                 float* y, int64_t M, int64_t N) {
  // Weight blocks per chunk: a chunk (about 128 KiB) stays in L2 while every row tile passes over it, and
  // holds whole four-block tiles (one row's widest).
  const int64_t block_bytes = K * kBlock * int64_t(sizeof(W));
  const int64_t chunk = std::max<int64_t>(4, ((128 << 10) / block_bytes + 2) / 4 * 4);
  // Row passes over a chunk after the first find it in L2, so they compute without reading memory: each
  // pass prefetches its share of the next chunk, and memory streams while they do.
  const int64_t passes = (M + 5) / 6;
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk), c2 = std::min(end, c1 + chunk);
      const char* next = reinterpret_cast<const char*>(w + c1 * K * kBlock);
      const int64_t next_bytes = (c2 - c1) * block_bytes;
      auto pass = [&](int64_t i) {
        const int64_t lo = next_bytes * i / passes, hi = next_bytes * (i + 1) / passes;
        return Prefetch{next + lo, hi - lo};
      };
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) rows<W, 6>(x + m * ldx, ldx, w, K, bias, y + m * N, N, N, c0, c1, pass(m / 6));
      const float* xm = x + m * ldx;
      float* ym = y + m * N;
      const Prefetch last = pass(m / 6);
      switch (M - m) {
        case 5: rows<W, 5>(xm, ldx, w, K, bias, ym, N, N, c0, c1, last); break;
        case 4: rows<W, 4>(xm, ldx, w, K, bias, ym, N, N, c0, c1, last); break;
        case 3: rows<W, 3>(xm, ldx, w, K, bias, ym, N, N, c0, c1, last); break;
        case 2: rows<W, 2>(xm, ldx, w, K, bias, ym, N, N, c0, c1, last); break;
        case 1: rows<W, 1>(xm, ldx, w, K, bias, ym, N, N, c0, c1, last); break;
        default: break;
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "kiln_cpu::linear: x must be 2-D float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kBlock && w.size(1) == x_in.size(1) && w.is_contiguous(),
              "kiln_cpu::linear: w must be packed [blocks, K, 16] with K = x.size(1)");
  TORCH_CHECK(n > (w.size(0) - 1) * kBlock && n <= w.size(0) * kBlock, "kiln_cpu::linear: n does not fit w");
  at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "kiln_cpu::linear: bias must be float32 [n]");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kHalf: linear_impl(xp, x.stride(0), w.data_ptr<c10::Half>(), K, NB, b, yp, M, n); break;
    case at::kBFloat16: linear_impl(xp, x.stride(0), w.data_ptr<c10::BFloat16>(), K, NB, b, yp, M, n); break;
    case at::kFloat: linear_impl(xp, x.stride(0), w.data_ptr<float>(), K, NB, b, yp, M, n); break;
    default: TORCH_CHECK(false, "kiln_cpu::linear: weights must be float32, float16 or bfloat16");
  }
  return y;
}

// ---------------------------------------------------------------------------------------------------
// Attention.

// e^x for eight lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial); e^-inf = 0.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

constexpr int kRows = 4;  // query rows of one request and kv head attended together: they share each K/V load

// Eight vectors' lane sums, each in hsum's order ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), as one
// vector [sum x[0], ..., sum x[7]]: a score is the same number whether it was reduced alone or with others.
inline __m256 hsum8(const __m256* x) {
  __m256 t[4];
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(x[i], x[i + 4], 0x20), _mm256_permute2f128_ps(x[i], x[i + 4], 0x31));
  __m256 y[2];
  for (int i = 0; i < 2; ++i)
    y[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_hadd_ps(y[0], y[1]);
}

#ifdef __AVX512VL__
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// s[r][j] = scale * q_r . k_j for rows r < R and keys j in [j0, j1), `stride` apart. Each score is one FMA
// chain over d, then summed in hsum's order: the same whichever rows and keys share its pass.
template <typename KV, int R>
inline void tile_scores(const float* const* q, const KV* k, int64_t stride, int64_t j0, int64_t j1, int64_t D,
                        float scale, float (*s)[64]) {
  // Keys per pass: R * P accumulators, P key vectors and a query vector in registers.
  constexpr int P = kVectorRegisters == 32 ? (R <= 2 ? 8 : 4) : (R <= 2 ? 4 : R == 3 ? 3 : 2);
  constexpr int N = R * P;
  const int64_t vec = D / 8 * 8;
  const __m256 vscale = _mm256_set1_ps(scale);
  auto finish = [&](__m256 a, int r, int64_t j) {
    float x = hsum(a);
    for (int64_t t = vec; t < D; ++t) x = std::fma(q[r][t], load1(k + j * stride + t), x);
    s[r][j] = x * scale;
  };
  int64_t j = j0;
  for (; j + P <= j1; j += P) {
    __m256 a[N];
#pragma GCC unroll 32
    for (int i = 0; i < N; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < vec; d += 8) {
      __m256 kv[P];
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) kv[p] = load8(k + (j + p) * stride + d);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) a[r * P + p] = _mm256_fmadd_ps(qv, kv[p], a[r * P + p]);
      }
    }
    if (vec < D) {
#pragma GCC unroll 32
      for (int i = 0; i < N; ++i) finish(a[i], i / P, j + i % P);
      continue;
    }
    int i = 0;
    for (; i + 8 <= N; i += 8) {
      const __m256 sums = _mm256_mul_ps(hsum8(a + i), vscale);
      if constexpr (P == 8) {
        _mm256_storeu_ps(s[i / P] + j, sums);
      } else if constexpr (P == 4) {
        _mm_storeu_ps(s[i / P] + j, _mm256_castps256_ps128(sums));
        _mm_storeu_ps(s[i / P + 1] + j, _mm256_extractf128_ps(sums, 1));
      } else {
        alignas(32) float sum[8];
        _mm256_store_ps(sum, sums);
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) s[(i + u) / P][j + (i + u) % P] = sum[u];
      }
    }
    for (; i < N; ++i) finish(a[i], i / P, j + i % P);
  }
  for (; j < j1; ++j) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < vec; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), load8(k + j * stride + d), a);
      finish(a, r, j);
    }
  }
}

// Rows r < R that have keys in this piece: acc_r = acc_r * alpha_r, then acc_r += e_r[j] * v_j for their
// keys j in order. Each lane is one FMA chain; lanes are grouped (VW vectors, across rows) for loads and
// registers only. Same: every row's keys are [u0, u1).
template <typename KV, int R, bool Same>
inline void tile_accumulate(float* acc, const float* alpha, const float (*e)[64], const int64_t* v0,
                            const int64_t* v1, const KV* v, int64_t stride, int64_t u0, int64_t u1, int64_t D) {
  constexpr int VW = kVectorRegisters == 32 ? (R <= 2 ? 8 : 4) : (R <= 2 ? 4 : 2);  // vectors of d per pass
  int64_t d = 0;
  for (; d + 8 * VW <= D; d += 8 * VW) {
    __m256 a[R][VW];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int w = 0; w < VW; ++w)
        a[r][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d + 8 * w), _mm256_set1_ps(alpha[r]));
    for (int64_t j = u0; j < u1; ++j) {
      __m256 vv[VW];
#pragma GCC unroll 8
      for (int w = 0; w < VW; ++w) vv[w] = load8(v + j * stride + d + 8 * w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (!Same && (j < v0[r] || j >= v1[r])) continue;
        const __m256 ev = _mm256_set1_ps(e[r][j]);
#pragma GCC unroll 8
        for (int w = 0; w < VW; ++w) a[r][w] = _mm256_fmadd_ps(ev, vv[w], a[r][w]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (!Same && v0[r] >= v1[r]) continue;
#pragma GCC unroll 8
      for (int w = 0; w < VW; ++w) _mm256_storeu_ps(acc + r * D + d + 8 * w, a[r][w]);
    }
  }
  for (; d + 8 <= D; d += 8) {
    for (int r = 0; r < R; ++r) {
      if (v0[r] >= v1[r]) continue;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), _mm256_set1_ps(alpha[r]));
      for (int64_t j = v0[r]; j < v1[r]; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(e[r][j]), load8(v + j * stride + d), a);
      _mm256_storeu_ps(acc + r * D + d, a);
    }
  }
  for (; d < D; ++d) {
    for (int r = 0; r < R; ++r) {
      if (v0[r] >= v1[r]) continue;
      float a = acc[r * D + d] * alpha[r];
      for (int64_t j = v0[r]; j < v1[r]; ++j) a = std::fma(e[r][j], load1(v + j * stride + d), a);
      acc[r * D + d] = a;
    }
  }
}

// Asks for this kv head's K and V rows of a KV-cache block ahead of use: blocks sit anywhere in the cache,
// so the hardware prefetcher cannot guess the next one, and decode attention otherwise waits on memory.
template <typename KV>
inline void prefetch_block(const KV* kb, int64_t bs, int64_t row, int64_t D) {
  const int64_t bytes = D * int64_t(sizeof(KV));
  for (int64_t j = 0; j < 2 * bs; ++j)
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(kb + j * row) + o, _MM_HINT_T1);
}

constexpr int64_t kAhead = 3;  // KV-cache blocks prefetched ahead of the one being read

struct Layout {
  const int32_t* qsl;
  const int32_t* seq_lens;
  const int32_t* table;
  int64_t table_width, bs, kvh_count, D, group;
  float scale;
  int64_t window;
};

// Request b's row t (a flat row index) sits at position offset(L, b) + t.
inline int64_t offset(const Layout& L, int64_t b) { return L.seq_lens[b] - (L.qsl[b + 1] - L.qsl[b]) - L.qsl[b]; }

// A query row of one head: flat row index t (request b's row t sits at position offset(L, b) + t), head h.
struct Row {
  int64_t t, h;
};

// R query rows of request `b`, all of kv head `kvh`, sharing every K/V load: rows of one head at consecutive
// positions (prefill), one position's query heads (decode), or a short group's rows of two heads. Each row
// walks its own context, [first, position], in KV-cache blocks cut into pieces of at most 64 keys at fixed
// offsets, with an online softmax: a row's arithmetic depends on its position alone, never on the rows it
// is grouped with (the pass spans the union of their contexts, and each row masks the rest).
template <typename KV, int R>
void attend(const Layout& L, const float* q, const KV* kv, float* out, int64_t b, const Row* rows, int64_t kvh,
            int64_t H, bool fetch, float* acc) {
  const int64_t D = L.D, bs = L.bs, row = L.kvh_count * D;
  const int32_t* table = L.table + b * L.table_width;
  constexpr float inf = std::numeric_limits<float>::infinity();
  int64_t pos[R], lo[R];
  const float* qr[R];
  for (int r = 0; r < R; ++r) {
    pos[r] = offset(L, b) + rows[r].t;
    lo[r] = L.window > 0 ? std::max<int64_t>(0, pos[r] - L.window + 1) : 0;
    qr[r] = q + (rows[r].t * H + rows[r].h) * D;
  }
  const int64_t first = *std::min_element(lo, lo + R) / bs, last = *std::max_element(pos, pos + R) / bs;
  auto block = [&](int64_t blk) { return kv + (int64_t(table[blk]) * 2 * bs) * row + kvh * D; };
  alignas(32) float s[R][64];
  alignas(32) float e[R][64];
  std::fill(acc, acc + R * D, 0.0f);
  float m[R], l[R], alpha[R], shift[8] = {};
  for (int r = 0; r < R; ++r) m[r] = -inf, l[r] = 0.0f, alpha[r] = 1.0f;
  // An item's first rows fetch the blocks; its later rows find them in L2.
  if (fetch)
    for (int64_t blk = first; blk < std::min(first + kAhead, last + 1); ++blk) prefetch_block(block(blk), bs, row, D);
  for (int64_t blk = first; blk <= last; ++blk) {
    const KV* kb = block(blk);
    const KV* vb = kb + bs * row;
    if (fetch && blk + kAhead <= last) prefetch_block(block(blk + kAhead), bs, row, D);
    for (int64_t c0 = 0; c0 < bs; c0 += 64) {
      const int64_t base = blk * bs + c0, len = std::min<int64_t>(64, bs - c0);
      int64_t v0[R], v1[R], u0 = len, u1 = 0;
      for (int r = 0; r < R; ++r) {
        v0[r] = std::clamp<int64_t>(lo[r] - base, 0, len);
        v1[r] = std::clamp<int64_t>(pos[r] + 1 - base, 0, len);
        if (v0[r] < v1[r]) u0 = std::min(u0, v0[r]), u1 = std::max(u1, v1[r]);
      }
      if (u0 >= u1) continue;
      tile_scores<KV, R>(qr, kb + c0 * row, row, u0, u1, D, L.scale, s);
      // e[r][j] = e^(s[r][j] - m_new) on row r's keys and 0 on the rest of the pass's keys, so that the rows'
      // sums of e run side by side with no branch (adding 0 leaves a sum as it was).
      const int64_t w0 = u0 / 8 * 8, w1 = (u1 + 7) / 8 * 8;
      for (int r = 0; r < R; ++r) {
        if (v0[r] >= v1[r]) {
          alpha[r] = 1.0f, shift[r] = 0.0f;
          for (int64_t j = w0; j < w1; j += 8) _mm256_store_ps(e[r] + j, _mm256_setzero_ps());
          continue;
        }
        const __m256i first_key = _mm256_set1_epi32(int(v0[r]) - 1), end_key = _mm256_set1_epi32(int(v1[r]));
        auto keys = [&](int64_t j) {
          const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(int(j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(at, first_key), _mm256_cmpgt_epi32(end_key, at)));
        };
        __m256 mv = _mm256_set1_ps(-inf);
        for (int64_t j = w0; j < w1; j += 8)
          mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-inf), _mm256_load_ps(s[r] + j), keys(j)));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mv);
        const float m_new = std::max(m[r], *std::max_element(lanes, lanes + 8));
        const __m256 mn = _mm256_set1_ps(m_new);
        for (int64_t j = w0; j < w1; j += 8) {
          const __m256 x = _mm256_sub_ps(_mm256_load_ps(s[r] + j), mn);
          _mm256_store_ps(e[r] + j, exp8(_mm256_blendv_ps(_mm256_set1_ps(-inf), x, keys(j))));
        }
        shift[r] = m[r] - m_new;
        m[r] = m_new;
      }
      // Every row's rescale e^(m_old - m_new) from one vector exp (lanes are rows; each lane's value is
      // the one a lone row gets).
      alignas(32) float scaled[8];
      _mm256_store_ps(scaled, exp8(_mm256_loadu_ps(shift)));
      for (int r = 0; r < R; ++r)
        if (v0[r] < v1[r]) alpha[r] = scaled[r], l[r] *= alpha[r];
      for (int64_t j = u0; j < u1; ++j)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) l[r] += e[r][j];
      // When every row's keys are all the pass's keys (most pieces: not a prefill's last, nor a sliding
      // window's first), the V pass skips its per-key test.
      const bool same = std::all_of(v0, v0 + R, [&](int64_t x) { return x == u0; }) &&
                        std::all_of(v1, v1 + R, [&](int64_t x) { return x == u1; });
      if (same)
        tile_accumulate<KV, R, true>(acc, alpha, e, v0, v1, vb + c0 * row, row, u0, u1, D);
      else
        tile_accumulate<KV, R, false>(acc, alpha, e, v0, v1, vb + c0 * row, row, u0, u1, D);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + (rows[r].t * H + rows[r].h) * D;
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
  }
}

// q [T, H, D] float32; kv_cache [blocks, 2, bs, KVH, D]; query_start_loc [B+1], seq_lens [B] and
// block_table [B, W] int32. Each request's rows are its last q_len positions; rows past the last
// request (padding) are zero.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                           int64_t sliding_window) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && q_in.dim() == 3, "kiln_cpu::paged_attention: q must be [T, H, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kiln_cpu::paged_attention: kv_cache must be [blocks, 2, block_size, KVH, D]");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "kiln_cpu::paged_attention: int32 layout tensors");
  at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "kiln_cpu::paged_attention: head shapes do not match");
  const int64_t B = seq_lens.size(0);
  Layout L{query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
           block_table.size(1), kv_cache.size(2), KVH, D, H / KVH, float(scale), sliding_window};
  at::Tensor out = at::zeros_like(q);
  // Groups of up to kRows consecutive rows of one request: (request, first row, rows), the longest
  // contexts first. Threads take work items one at a time: split evenly, a causal prefill's later (longer)
  // rows would all land on the last thread.
  std::vector<std::array<int64_t, 3>> groups;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = std::min<int64_t>(L.qsl[b + 1], T);
    for (int64_t t = L.qsl[b]; t < end; t += kRows) groups.push_back({b, t, std::min<int64_t>(kRows, end - t)});
  }
  auto context = [&](const std::array<int64_t, 3>& g) {
    return offset(L, g[0]) + g[1] + g[2];
  };
  std::stable_sort(groups.begin(), groups.end(), [&](const auto& x, const auto& y) { return context(x) > context(y); });
  const int64_t n = int64_t(groups.size());
  // Work items: (group, kv head) with its query heads together, or single heads when that is too few
  // items to keep every thread busy (a decode of one sequence).
  const int64_t split = n * KVH < 4 * at::get_num_threads() ? L.group : 1;
  const int64_t per = L.group / split;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t items = n * KVH * split;
  auto run = [&](auto* kv) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kv)>>;
#pragma omp parallel num_threads(int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items))))
    {
      std::vector<float> acc(kRows * D);
      std::vector<Row> rows(kRows * L.group);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < items; ++i) {
        const auto [b, t0, n_rows] = groups[i / (KVH * split)];
        const int64_t kvh = (i / split) % KVH, g0 = (i % split) * per, g1 = g0 + per;
        // The item's rows, head by head, attended kRows at a time: a decode's query heads share a pass.
        int64_t count = 0;
        for (int64_t g = g0; g < g1; ++g)
          for (int64_t r = 0; r < n_rows; ++r) rows[count++] = {t0 + r, kvh * L.group + g};
        for (int64_t r0 = 0; r0 < count; r0 += kRows) {
          const Row* chunk = rows.data() + r0;
          switch (std::min<int64_t>(kRows, count - r0)) {
            case 4: attend<KV, 4>(L, qp, kv, op, b, chunk, kvh, H, r0 == 0, acc.data()); break;
            case 3: attend<KV, 3>(L, qp, kv, op, b, chunk, kvh, H, r0 == 0, acc.data()); break;
            case 2: attend<KV, 2>(L, qp, kv, op, b, chunk, kvh, H, r0 == 0, acc.data()); break;
            default: attend<KV, 1>(L, qp, kv, op, b, chunk, kvh, H, r0 == 0, acc.data()); break;
          }
        }
      }
    }
  };
  switch (kv_cache.scalar_type()) {
    case at::kHalf: run(kv_cache.data_ptr<c10::Half>()); break;
    case at::kBFloat16: run(kv_cache.data_ptr<c10::BFloat16>()); break;
    case at::kFloat: run(kv_cache.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "kiln_cpu::paged_attention: kv_cache must be float32, float16 or bfloat16");
  }
  return out;
}

// Structured output: -inf on each listed row's tokens whose bit is clear, in xgrammar's layout (token t is
// bit t % 32 of word t / 32 of the row). Eight tokens per AVX2 blend; a word of all-allowed is skipped.
void apply_bitmask(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "kiln_cpu::apply_bitmask: logits must be 2-D float32 with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1,
              "kiln_cpu::apply_bitmask: bitmask must be 2-D int32 with contiguous rows");
  const int64_t V = std::min(logits.size(1), bitmask.size(1) * 32);
  for (int64_t r : rows) {
    TORCH_CHECK(0 <= r && r < logits.size(0) && r < bitmask.size(0), "kiln_cpu::apply_bitmask: row out of range");
  }
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t ls = logits.stride(0), bs = bitmask.stride(0);
  const std::vector<int64_t> list(rows.begin(), rows.end());
  at::parallel_for(0, static_cast<int64_t>(list.size()), 1, [&](int64_t begin, int64_t end) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 blocked = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + list[i] * ls;
      const int32_t* bits = words + list[i] * bs;
      const int64_t full = V / 32;
      for (int64_t w = 0; w < full; ++w) {
        if (bits[w] == -1) continue;
        const __m256i word = _mm256_set1_epi32(bits[w]);
        for (int g = 0; g < 4; ++g) {
          const __m256i sel = _mm256_slli_epi32(lane, 8 * g);
          const __m256 allowed = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(word, sel), sel));
          float* p = row + w * 32 + 8 * g;
          _mm256_storeu_ps(p, _mm256_blendv_ps(blocked, _mm256_loadu_ps(p), allowed));
        }
      }
      for (int64_t t = full * 32; t < V; ++t) {
        if (!((static_cast<uint32_t>(bits[t / 32]) >> (t % 32)) & 1u)) row[t] = -std::numeric_limits<float>::infinity();
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("linear(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale, int sliding_window) -> Tensor");
  m.def("apply_bitmask(Tensor(a!) logits, Tensor bitmask, int[] rows) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("paged_attention", &paged_attention);
  m.impl("apply_bitmask", &apply_bitmask);
}
