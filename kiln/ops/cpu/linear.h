// Linear layers over packed weights (AVX2 FMA, AVX512-BF16 pairs, AMX tiles) and AMX's fused gate_up.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

// linear: x [M, K] float32 (rows may be strided), bias [N] float32 or none -> y [M, N] float32, with w in
// one of two packings (kiln/ops/matmul.py's CpuMatmul.pack):
//  - [NB, K, 16] of any W (column n of block b is w[b, :, n % 16], zero past N): x times w widened to
//    float32, one FMA per k (Widen);
//  - [NB, K2, 16, 2] bfloat16, pairs of k side by side (K2 = 16 * ceil(K / 32), zero past K), on CPUs with
//    AVX512-BF16: x rounded to bfloat16 times w, one dot product of a pair per step, accumulated in
//    float32 (Dot; twice Widen's multiplies per instruction), or with AMX, 16 pairs of k for 16 rows by
//    16 columns per tile multiply (linear_amx).

// Weight bytes to bring into L2 while a tile computes: the next chunk's, spread over the tile's step loop.
struct Prefetch {
  const char* base = nullptr;
  int64_t bytes = 0;
};

// Issues pf's lines evenly over `steps` calls.
struct Prefetcher {
  Prefetch pf;
  int64_t steps, lines, issued = 0, due = 0;
  Prefetcher(Prefetch p, int64_t s) : pf(p), steps(s), lines((p.bytes + 63) / 64) {}
  __attribute__((always_inline)) inline void step() {
    for (due += lines; due >= steps; due -= steps) _mm_prefetch(pf.base + 64 * issued++, _MM_HINT_T1);
  }
};

// A tile's accumulators, spilled to `out` ([MR][width] floats), plus bias, into y's columns from n0.
template <int MR>
__attribute__((always_inline)) inline void emit(const float* out, int64_t width_out, const float* bias, float* y, int64_t ldy, int64_t n0,
                 int64_t N) {
  const int64_t width = std::min<int64_t>(width_out, N - n0);
  for (int m = 0; m < MR; ++m) {
    float* dst = y + m * ldy + n0;
    const float* src = out + m * width_out;
    if (bias)
      for (int64_t i = 0; i < width; ++i) dst[i] = src[i] + bias[n0 + i];
    else
      for (int64_t i = 0; i < width; ++i) dst[i] = src[i];
  }
}

template <typename W>
struct Widen {
  using X = float;
  using Weight = W;
  static constexpr int kRows = 6;               // rows per pass
  static constexpr int kWide = 1;               // blocks per tile from 3 rows on
  static constexpr int64_t kStep = kBlock;      // weights per block per step (one k)

  // MR rows by NB blocks: MR * NB * 2 accumulators, each one column vector's FMA chain over k.
  template <int MR, int NB>
  static inline void tile(const X* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* y,
                          int64_t ldy, int64_t n0, int64_t N, Prefetch pf) {
    Prefetcher prefetch(pf, K);
    __m256 acc[MR][NB * 2];
#pragma GCC unroll 24
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < NB * 2; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      prefetch.step();
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
    alignas(64) float out[MR][NB * kBlock];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < NB * 2; ++j) _mm256_store_ps(&out[m][j * 8], acc[m][j]);
    emit<MR>(&out[0][0], NB * kBlock, bias, y, ldy, n0, N);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
constexpr bool kBf16Dot = true;

struct Dot {
  using X = uint32_t;  // a pair of bfloat16: x[m, 2s] in the low half, x[m, 2s + 1] in the high
  using Weight = c10::BFloat16;
  static constexpr int kRows = 8;
  static constexpr int kWide = 2;
  static constexpr int64_t kStep = 2 * kBlock;  // a pair of k for 16 columns: one 512-bit vector

  // MR rows by NB blocks: MR * NB accumulators, each 16 columns' dot-product chain over the pairs.
  template <int MR, int NB>
  static inline void tile(const X* x, int64_t ldx, const Weight* w, int64_t K2, const float* bias, float* y,
                          int64_t ldy, int64_t n0, int64_t N, Prefetch pf) {
    Prefetcher prefetch(pf, K2);
    __m512 acc[MR][NB];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t s = 0; s < K2; ++s) {
      prefetch.step();
      __m512bh wv[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * K2 + s) * kStep);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + s]));
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
      }
    }
    alignas(64) float out[MR][NB * kBlock];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) _mm512_store_ps(&out[m][b * kBlock], acc[m][b]);
    emit<MR>(&out[0][0], NB * kBlock, bias, y, ldy, n0, N);
  }
};

// x [M, K] float32 -> [M, K2] pairs of bfloat16 (round to nearest even), zero past K.
at::Tensor to_pairs(const at::Tensor& x, int64_t K2) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  at::Tensor out = at::empty({M, K2}, x.options().dtype(at::kInt));
  const float* src = x.data_ptr<float>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = src + m * ldx;
      for (int64_t k = 0; k < 2 * K2; k += 32) {
        auto mask = [&](int64_t at) { return __mmask16(at >= K ? 0 : at + 16 <= K ? 0xFFFF : (1u << (K - at)) - 1); };
        const __m512 lo = _mm512_maskz_loadu_ps(mask(k), row + k), hi = _mm512_maskz_loadu_ps(mask(k + 16), row + k + 16);
        const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        const int64_t left = std::min<int64_t>(16, K2 - k / 2);
        _mm512_mask_storeu_epi32(dst + m * K2 + k / 2, __mmask16((1u << left) - 1), pairs);
      }
    }
  });
  return out;
}

// x's rows as pairs for K2 pairs of k, and their stride in pairs: a bfloat16 x is its own pairs (read in
// place), a float32 x is rounded into a copy.
std::pair<at::Tensor, int64_t> pairs_of(const at::Tensor& x, int64_t K2) {
  if (x.scalar_type() == at::kBFloat16) return {x, x.stride(0) / 2};
  return {to_pairs(x, K2), K2};
}
#else
constexpr bool kBf16Dot = false;
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX: the pair packing is the tile multiply's own B layout. A block's 16 pairs of k for its 16 columns are
// one 16 x 64-byte tile, and up to 16 rows' 16 pairs of x one A tile; one TDPBF16PS adds their products
// into a float32 tile of as many rows by 16 columns. Every call runs every row through the same tile chain
// over k in order, whatever M (a pass's last tile is configured with the rows left), so a row's bits
// never depend on the rows beside it. Linux grants a process the tile state on request.
bool amx() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-1: A (x rows), tmm2-3: B (weight blocks), tmm4-7: C. Every tile is 64 bytes wide and B has 16 rows
// (pairs of k). One row tile (second = 0): tmm0 and tmm4-7 have `first` rows. Two: tmm0, tmm4 and tmm5
// have `first`, tmm1, tmm6 and tmm7 `second`.
inline void configure_tiles(int first, int second) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t == 2 || t == 3 ? 16 : second > 0 && (t == 1 || t >= 6) ? second : first;
  }
  _tile_loadconfig(&c);
}

// The tile intrinsics are asm without memory operands: fence the compiler around them.
inline void compiler_fence() { asm volatile("" ::: "memory"); }

// The weights' tiles load with the streaming hint: they pass through L2 without evicting x's rows from L1,
// which every block's tiles reload (each tile load otherwise waits on L2). pf steps once per k step.

// One row tile by nb (1-4) blocks: C tiles tmm4.. over all K2 pairs, stored to out (rows ldo floats apart).
inline void amx_row_tile(const uint32_t* x, int64_t ldx, const c10::BFloat16* w, int64_t K2, int nb, float* out,
                         int64_t ldo, Prefetcher& pf) {
  const int64_t sx = ldx * 4, block = K2 * 2 * kBlock;
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  for (int64_t s = 0; s < K2; s += 16) {
    pf.step();
    const c10::BFloat16* ws = w + s * 2 * kBlock;
    _tile_loadd(0, x + s, sx);
    _tile_stream_loadd(2, ws, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (nb > 1) { _tile_stream_loadd(3, ws + block, 64); _tile_dpbf16ps(5, 0, 3); }
    if (nb > 2) { _tile_stream_loadd(2, ws + 2 * block, 64); _tile_dpbf16ps(6, 0, 2); }
    if (nb > 3) { _tile_stream_loadd(3, ws + 3 * block, 64); _tile_dpbf16ps(7, 0, 3); }
  }
  const int64_t so = ldo * 4;
  _tile_stored(4, out, so);
  if (nb > 1) _tile_stored(5, out + 16, so);
  if (nb > 2) _tile_stored(6, out + 32, so);
  if (nb > 3) _tile_stored(7, out + 48, so);
}

// Two row tiles (up to 32 rows) by nb (1-2) blocks, stored to out (rows ldo floats apart).
inline void amx_two_row_tiles(const uint32_t* x, int64_t ldx, const c10::BFloat16* w, int64_t K2, int nb, float* out,
                              int64_t ldo, Prefetcher& pf) {
  const int64_t sx = ldx * 4, block = K2 * 2 * kBlock;
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  for (int64_t s = 0; s < K2; s += 16) {
    pf.step();
    const c10::BFloat16* ws = w + s * 2 * kBlock;
    _tile_loadd(0, x + s, sx);
    _tile_loadd(1, x + 16 * ldx + s, sx);
    _tile_stream_loadd(2, ws, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(6, 1, 2);
    if (nb > 1) { _tile_stream_loadd(3, ws + block, 64); _tile_dpbf16ps(5, 0, 3); _tile_dpbf16ps(7, 1, 3); }
  }
  const int64_t so = ldo * 4;
  _tile_stored(4, out, so); _tile_stored(6, out + 16 * ldo, so);
  if (nb > 1) { _tile_stored(5, out + 16, so); _tile_stored(7, out + 16 * ldo + 16, so); }
}

// silu(g) * u for sixteen lanes, rounded to bfloat16 (nearest even) into h.
inline void silu_mul16(__m512 g, __m512 u, c10::BFloat16* h) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u)));
}

// x: [M, K2] pairs, rows ldx apart. y [M, N] float32; or, gated, h [M, N / 2] bfloat16 = silu(gate) * up,
// with w's blocks interleaved (gate's 16 columns, then up's same 16: CpuMatmul.pack_gate_up) and bias
// likewise: each pair of blocks' tiles meet in the tile's output, so the gate_up product is never stored.
void linear_amx(const uint32_t* x, int64_t ldx, int64_t K2, const c10::BFloat16* w, int64_t NB, const float* bias,
                float* y, int64_t M, int64_t N, c10::BFloat16* h = nullptr) {
  const int64_t block_bytes = K2 * 2 * kBlock * 2;
  // Blocks per chunk: a chunk (about 256 KiB) stays in L2 while every row tile of a row block passes over
  // it; a row block of x (about 512 KiB) stays there while every chunk passes over it.
  const int64_t chunk = std::max<int64_t>(4, (256 << 10) / block_bytes / 4 * 4);
  const int64_t row_block = std::max<int64_t>(32, (512 << 10) / (K2 * 4) / 32 * 32);
  const int64_t unit = h ? 2 : 1;  // gated: threads take whole (gate, up) pairs of blocks
  at::parallel_for(0, NB / unit, 1, [&](int64_t begin, int64_t end) {
    begin *= unit, end *= unit;
    int config = -1;  // the configured pass's rows
    alignas(64) float out[32][64];
    // Tiles store straight into y, unless a bias is added or the blocks run past N: then through out.
    auto multiply = [&](auto tiles, int64_t m0, int64_t rows, int64_t b, int nb, Prefetcher& pf) {
      const int64_t n0 = b * kBlock, width = std::min<int64_t>(nb * kBlock, N - n0);
      const uint32_t* xm = x + m0 * ldx;
      const c10::BFloat16* wb = w + b * K2 * 2 * kBlock;
      if (!h && !bias && width == nb * kBlock) return tiles(xm, ldx, wb, K2, nb, y + m0 * N + n0, N, pf);
      tiles(xm, ldx, wb, K2, nb, &out[0][0], 64, pf);
      compiler_fence();
      if (h) {
        for (int64_t m = 0; m < rows; ++m)
          for (int p = 0; p < nb; p += 2) {
            __m512 g = _mm512_load_ps(&out[m][16 * p]), u = _mm512_load_ps(&out[m][16 * p + 16]);
            if (bias) {
              g = _mm512_add_ps(g, _mm512_loadu_ps(bias + n0 + 16 * p));
              u = _mm512_add_ps(u, _mm512_loadu_ps(bias + n0 + 16 * p + 16));
            }
            silu_mul16(g, u, h + (m0 + m) * (N / 2) + n0 / 2 + 8 * p);
          }
        return;
      }
      for (int64_t m = 0; m < rows; ++m) {
        float* dst = y + (m0 + m) * N + n0;
        if (bias)
          for (int64_t i = 0; i < width; ++i) dst[i] = out[m][i] + bias[n0 + i];
        else
          for (int64_t i = 0; i < width; ++i) dst[i] = out[m][i];
      }
    };
    // While a chunk's row passes run on the tiles, the next chunk comes into L2: with the hardware
    // prefetcher alone, the tiles wait on the weights' stream from DRAM and do not overlap it. One row
    // tile's pass is the stream itself (a decode of up to 16 rows), which the hardware keeps up with alone.
    for (int64_t r0 = 0; r0 < M; r0 += row_block) {
      const int64_t r1 = std::min(M, r0 + row_block);
      for (int64_t c0 = begin; c0 < end; c0 += chunk) {
        const int64_t c1 = std::min(end, c0 + chunk);
        const int64_t p0 = c1 < end ? c1 : r1 < M ? begin : end, p1 = std::min(end, p0 + chunk);  // the next chunk
        int64_t steps = 0;
        for (int64_t m0 = r0; m0 < r1; m0 += 32) {  // tile calls (2 or 4 blocks each) times their k steps
          const int64_t nb = r1 - m0 > 16 ? 2 : 4;
          steps += (c1 - c0 + nb - 1) / nb * (K2 / 16);
        }
        Prefetcher pf({reinterpret_cast<const char*>(w + p0 * K2 * 2 * kBlock), M > 16 ? (p1 - p0) * block_bytes : 0},
                      std::max<int64_t>(1, steps));
        for (int64_t m0 = r0; m0 < r1; m0 += 32) {
          const int64_t rows = std::min<int64_t>(32, r1 - m0);
          if (rows != config) {
            configure_tiles(static_cast<int>(std::min<int64_t>(rows, 16)), static_cast<int>(std::max<int64_t>(rows - 16, 0)));
            config = static_cast<int>(rows);
          }
          if (rows > 16)
            for (int64_t b = c0; b < c1; b += 2) multiply(amx_two_row_tiles, m0, rows, b, int(std::min<int64_t>(2, c1 - b)), pf);
          else
            for (int64_t b = c0; b < c1; b += 4) multiply(amx_row_tile, m0, rows, b, int(std::min<int64_t>(4, c1 - b)), pf);
        }
      }
    }
    _tile_release();
  });
}
#else
bool amx() { return false; }
#endif


// Blocks [b0, b1) for rows [0, MR): the tile shape follows the rows left, never the arithmetic.
template <typename P, int MR>
inline void rows(const typename P::X* x, int64_t ldx, const typename P::Weight* w, int64_t steps, const float* bias,
                 float* y, int64_t ldy, int64_t N, int64_t b0, int64_t b1, Prefetch pf) {
  constexpr int NB = MR == 1 ? 4 : MR == 2 ? 2 : P::kWide;
  const int64_t block = steps * P::kStep;
  // Each tile prefetches its share of pf, in proportion to its blocks.
  auto share = [&](int64_t b, int64_t nb) {
    const int64_t lo = pf.bytes * (b - b0) / (b1 - b0), hi = pf.bytes * (b - b0 + nb) / (b1 - b0);
    return Prefetch{pf.base + lo, hi - lo};
  };
  int64_t b = b0;
  for (; b + NB <= b1; b += NB)
    P::template tile<MR, NB>(x, ldx, w + b * block, steps, bias, y, ldy, b * kBlock, N, share(b, NB));
  for (; b < b1; ++b) P::template tile<MR, 1>(x, ldx, w + b * block, steps, bias, y, ldy, b * kBlock, N, share(b, 1));
}

// The last pass's R rows (R < kRows), dispatched to a tile of exactly that many.
template <typename P, int R>
inline void last_rows(int64_t r, const typename P::X* x, int64_t ldx, const typename P::Weight* w, int64_t steps,
                      const float* bias, float* y, int64_t N, int64_t b0, int64_t b1, Prefetch pf) {
  if constexpr (R > 0) {
    if (r == R) return rows<P, R>(x, ldx, w, steps, bias, y, N, N, b0, b1, pf);
    last_rows<P, R - 1>(r, x, ldx, w, steps, bias, y, N, b0, b1, pf);
  }
}

template <typename P>
void linear_impl(const typename P::X* x, int64_t ldx, const typename P::Weight* w, int64_t steps, int64_t NB,
                 const float* bias, float* y, int64_t M, int64_t N) {
  // Weight blocks per chunk: a chunk (about 128 KiB) stays in L2 while every row tile passes over it, and
  // holds whole four-block tiles (one row's widest).
  const int64_t block_bytes = steps * P::kStep * int64_t(sizeof(typename P::Weight));
  const int64_t chunk = std::max<int64_t>(4, ((128 << 10) / block_bytes + 2) / 4 * 4);
  // Row passes over a chunk after the first find it in L2, so they compute without reading memory: each
  // pass prefetches its share of the next chunk, and memory streams while they do.
  constexpr int R = P::kRows;
  const int64_t passes = (M + R - 1) / R;
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk), c2 = std::min(end, c1 + chunk);
      const char* next = reinterpret_cast<const char*>(w + c1 * steps * P::kStep);
      const int64_t next_bytes = (c2 - c1) * block_bytes;
      auto pass = [&](int64_t i) {
        const int64_t lo = next_bytes * i / passes, hi = next_bytes * (i + 1) / passes;
        return Prefetch{next + lo, hi - lo};
      };
      int64_t m = 0;
      for (; m + R <= M; m += R) rows<P, R>(x + m * ldx, ldx, w, steps, bias, y + m * N, N, N, c0, c1, pass(m / R));
      last_rows<P, R - 1>(M - m, x + m * ldx, ldx, w, steps, bias, y + m * N, N, c0, c1, pass(m / R));
    }
  });
}

// x [M, K] float32 with any w; or, with pair-packed w and K a multiple of 32, bfloat16 (its rows are their
// own pairs: a producer that rounds them saves this call rounding a float32 copy).
// x with its columns adjacent and, in bfloat16 (K a multiple of 32), its rows whole pairs apart: x itself
// where it is so, else a contiguous copy.
at::Tensor readable(const at::Tensor& x, const char* op) {
  const bool rounded = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!rounded || x.size(1) % 32 == 0, op, ": bfloat16 x needs K a multiple of 32");
  return x.stride(1) == 1 && (!rounded || x.stride(0) % 2 == 0) ? x : x.contiguous();
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias) {
  const bool dot = w.dim() == 4;
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || (dot && x_in.scalar_type() == at::kBFloat16)),
              "kiln_cpu::linear: x must be 2-D float32, or bfloat16 with pair-packed weights");
  const int64_t K = x_in.size(1);
  const bool packed = dot ? w.size(1) == (K + 31) / 32 * 16 && w.size(2) == kBlock && w.size(3) == 2
                          : w.dim() == 3 && w.size(1) == K && w.size(2) == kBlock;
  TORCH_CHECK(packed && w.is_contiguous(),
              "kiln_cpu::linear: w must be packed [blocks, K, 16], or [blocks, ceil(K / 32) * 16, 16, 2] in bfloat16");
  TORCH_CHECK(n > (w.size(0) - 1) * kBlock && n <= w.size(0) * kBlock, "kiln_cpu::linear: n does not fit w");
  const at::Tensor x = readable(x_in, "kiln_cpu::linear");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "kiln_cpu::linear: bias must be float32 [n]");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), NB = w.size(0);
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  float* yp = y.data_ptr<float>();
  if (dot) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "kiln_cpu::linear: pair-packed weights must be bfloat16");
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const int64_t K2 = w.size(1);
    const auto [pairs, ldp] = pairs_of(x, K2);
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(pairs.data_ptr());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx()) {
      linear_amx(xp, ldp, K2, w.data_ptr<c10::BFloat16>(), NB, b, yp, M, n);
      return y;
    }
#endif
    linear_impl<Dot>(xp, ldp, w.data_ptr<c10::BFloat16>(), K2, NB, b, yp, M, n);
#else
    TORCH_CHECK(false, "kiln_cpu::linear: pair-packed weights need a CPU with AVX512-BF16");
#endif
    return y;
  }
  const float* xp = x.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kHalf: linear_impl<Widen<c10::Half>>(xp, x.stride(0), w.data_ptr<c10::Half>(), K, NB, b, yp, M, n); break;
    case at::kBFloat16: linear_impl<Widen<c10::BFloat16>>(xp, x.stride(0), w.data_ptr<c10::BFloat16>(), K, NB, b, yp, M, n); break;
    case at::kFloat: linear_impl<Widen<float>>(xp, x.stride(0), w.data_ptr<float>(), K, NB, b, yp, M, n); break;
    default: TORCH_CHECK(false, "kiln_cpu::linear: weights must be float32, float16 or bfloat16");
  }
  return y;
}

// silu(gate) * up of x times w packed by CpuMatmul.pack_gate_up (blocks of gate and up interleaved), bias
// likewise: [M, n] bfloat16, the next linear layer's own pairs. x as for linear; AMX only.
at::Tensor gate_up(const at::Tensor& x_in, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx() && w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "kiln_cpu::gate_up: needs AMX and pair-packed bfloat16 weights");
  TORCH_CHECK(n % kBlock == 0 && w.size(0) * kBlock == 2 * n, "kiln_cpu::gate_up: w must hold 2 n columns, n a multiple of 16");
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "kiln_cpu::gate_up: x must be 2-D float32 or bfloat16");
  const int64_t K = x_in.size(1), K2 = w.size(1);
  TORCH_CHECK(K2 == (K + 31) / 32 * 16 && w.size(2) == kBlock && w.size(3) == 2, "kiln_cpu::gate_up: w does not fit x");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == 2 * n),
              "kiln_cpu::gate_up: bias must be float32 [2 n]");
  const at::Tensor x = readable(x_in, "kiln_cpu::gate_up");
  const int64_t M = x.size(0);
  at::Tensor h = at::empty({M, n}, x.options().dtype(at::kBFloat16));
  if (M == 0) return h;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const auto [pairs, ldp] = pairs_of(x, K2);
  linear_amx(reinterpret_cast<const uint32_t*>(pairs.data_ptr()), ldp, K2, w.data_ptr<c10::BFloat16>(), w.size(0),
             bias.has_value() ? bias->data_ptr<float>() : nullptr, nullptr, M, 2 * n, h.data_ptr<c10::BFloat16>());
#endif
  return h;
}

bool bf16_dot() { return kBf16Dot; }
