// Paged attention over the KV cache (vectors, or AMX tiles), and its entry point.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

// Attention. The cache keeps each block's K transposed per kv head, [KVH, D, bs], and its V as [KVH, bs, D]
// (bfloat16 with AVX512-BF16: K as [KVH, D/2, bs, 2], pairs of d, and V as [KVH, bs/2, D, 2], pairs of
// keys; kiln/ops/cpu/attention.py writes it): a piece of keys' scores are then one FMA (or pair dot product)
// chain over d per key with keys along the vector lanes, the way the linear layers' micro-kernel runs, and
// no score needs a horizontal sum.


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// 2^x for sixteen lanes, x <= 0: x = n + f with n whole and |f| <= 1/2, 2^f by a degree-3 minimax
// polynomial, times 2^n by scalef. Its relative error, 7.5e-5, is a 26th of the rounding of the bfloat16
// weight e it becomes, and it takes half the multiplies of degree 6 (long prefills' attention is bound by
// the softmax's vector work: 5-10% faster). Below -150 the result is 0 (2^-inf = 0).
// Finite: x holds no -inf, and the clamp at -150 is skipped (it changes no finite result's bits).
template <bool Finite = false>
inline __m512 exp2_16(__m512 x) {
  if constexpr (!Finite) x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.5171094834804535e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260999262332916e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.932609677314758e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999281167984009e-1f));
  return _mm512_scalef_ps(p, n);
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

#ifdef __AVX512VL__
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
// Query rows of one kv head that share a pass over the keys: R rows by two vectors of accumulators, two
// vectors of K or V and a broadcast, in registers.
constexpr int kPassRows = kVectorRegisters == 32 ? 12 : 6;
constexpr int64_t kPiece = 16;  // keys per online-softmax step: two vectors

// s[i][r][j] = scale * (q_r . k_j) for keys j < 8 * NV of NP pieces; qt holds the rows' queries as [D, R],
// kt[i] piece i's K^T rows (bs apart). Each score is one FMA chain over d in order, whichever rows and
// pieces share the pass (a small pass scores several pieces, for enough independent chains).
template <typename KV, int R, int NV, int NP>
inline void piece_scores(const float* qt, const KV* const* kt, int64_t bs, int64_t D, float scale,
                         float (*s)[R][kPiece]) {
  __m256 a[NP][R][NV];
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int p = 0; p < NV; ++p) a[i][r][p] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 k[NP][NV];
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i)
#pragma GCC unroll 2
      for (int p = 0; p < NV; ++p) k[i][p] = load8(kt[i] + d * bs + 8 * p);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_broadcast_ss(qt + d * R + r);
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i)
#pragma GCC unroll 2
        for (int p = 0; p < NV; ++p) a[i][r][p] = _mm256_fmadd_ps(qd, k[i][p], a[i][r][p]);
    }
  }
  const __m256 vscale = _mm256_set1_ps(scale);
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int p = 0; p < NV; ++p) _mm256_store_ps(s[i][r] + 8 * p, _mm256_mul_ps(a[i][r][p], vscale));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// piece_scores with K in pairs of d ([D/2, bs, 2]) and qp the rows' queries as bfloat16 pairs [D/2, R]:
// each score is one chain of pair dot products over d, sixteen keys to a vector. A piece of fewer keys (a
// block of 8) reads on into the next row of pairs; those lanes are masked. K is bfloat16, or fp8 widened
// to it (pairs32).
template <typename KV, int R, int NP>
inline void piece_score_pairs(const uint32_t* qp, const KV* const* kt, int64_t bs, int64_t D, float scale,
                              float (*s)[R][kPiece]) {
  __m512 a[NP][R];
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[i][r] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh k[NP];
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) k[i] = pairs32(kt[i] + d2 * 2 * bs);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh qd = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[d2 * R + r]));
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i) a[i][r] = _mm512_dpbf16_ps(a[i][r], qd, k[i]);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_store_ps(s[i][r], _mm512_mul_ps(a[i][r], vscale));
}
#endif

// acc_r[d, d + 8 VW) = acc_r * alpha_r + e_r[j] * v_j for keys j in [u0, u1) in order: one FMA chain per lane.
template <typename KV, int R, int VW>
inline void piece_values(float* acc, const float* alpha, const float (*e)[kPiece], const KV* v, int64_t D,
                         int64_t u0, int64_t u1, int64_t d) {
  __m256 a[R][VW];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int w = 0; w < VW; ++w) a[r][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d + 8 * w), _mm256_set1_ps(alpha[r]));
  for (int64_t j = u0; j < u1; ++j) {
    __m256 vv[VW];
#pragma GCC unroll 2
    for (int w = 0; w < VW; ++w) vv[w] = load8(v + j * D + d + 8 * w);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 ev = _mm256_broadcast_ss(e[r] + j);
#pragma GCC unroll 2
      for (int w = 0; w < VW; ++w) a[r][w] = _mm256_fmadd_ps(ev, vv[w], a[r][w]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int w = 0; w < VW; ++w) _mm256_storeu_ps(acc + r * D + d + 8 * w, a[r][w]);
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// With pairs, V is [KVH, bs/2, D, 2]: keys 2p and 2p + 1 of a block side by side for each d. acc_r[d] =
// acc_r[d] * alpha_r + the pair dot products of (e_r[2p], e_r[2p + 1]) with (v_2p[d], v_2p+1[d]) for pairs p
// over keys [u0, u1) in order: one chain per lane, accumulated in float32. A pair's key outside [u0, u1) is
// loaded as zero: it may be a slot not written yet, whose bits need not be a number (0 * NaN is NaN).
template <typename KV, int R, int VW>
inline void piece_value_pairs(float* acc, const float* alpha, const uint32_t (*ep)[kPiece / 2], const KV* v,
                              int64_t D, int64_t u0, int64_t u1, int64_t d) {
  __mmask16 lanes[VW];
  __mmask32 halves[VW];  // the bfloat16 elements of lanes
#pragma GCC unroll 2
  for (int w = 0; w < VW; ++w) {
    const int64_t n = std::clamp<int64_t>(D - d - 16 * w, 0, 16);
    lanes[w] = __mmask16((1u << n) - 1);
    halves[w] = __mmask32(n == 16 ? ~0u : (1u << 2 * n) - 1);
  }
  __m512 a[R][VW];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int w = 0; w < VW; ++w)
      a[r][w] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes[w], acc + r * D + d + 16 * w), _mm512_set1_ps(alpha[r]));
  for (int64_t p = u0 / 2; 2 * p < u1; ++p) {
    const __mmask32 keys = (2 * p >= u0 ? 0x55555555u : 0u) | (2 * p + 1 < u1 ? 0xAAAAAAAAu : 0u);
    __m512bh vv[VW];
#pragma GCC unroll 2
    for (int w = 0; w < VW; ++w)
      vv[w] = pairs32(v + 2 * (p * D + d + 16 * w), keys & halves[w]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh ev = (__m512bh)_mm512_set1_epi32(static_cast<int>(ep[r][p]));
#pragma GCC unroll 2
      for (int w = 0; w < VW; ++w) a[r][w] = _mm512_dpbf16_ps(a[r][w], ev, vv[w]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int w = 0; w < VW; ++w) _mm512_mask_storeu_ps(acc + r * D + d + 16 * w, lanes[w], a[r][w]);
}
#endif

// Asks for this kv head's K^T and V of a KV-cache block ahead of use: blocks sit anywhere in the cache, so
// the hardware prefetcher cannot guess the next one, and decode attention otherwise waits on memory.
template <typename KV>
inline void prefetch_block(const KV* kt, const KV* v, int64_t elements) {
  const int64_t bytes = elements * int64_t(sizeof(KV));
  for (const KV* p : {kt, v})
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T1);
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

// R query rows of request `b`, all of kv head `kvh`, sharing every K/V load: a prefill's rows of the
// group's heads at consecutive positions, or a decode's query heads. Each row walks its own context,
// [first, position], in KV-cache blocks cut into pieces of at most kPiece keys at fixed offsets, with an
// online softmax: a row's arithmetic depends on its position alone, never on the rows it is grouped with
// (the pass spans the union of their contexts; a row's scores off its own keys are masked, and on keys
// the pass spans but the row does not, e = 0 adds nothing to its sums).
template <typename KV, int R, bool Pairs>
void attend(const Layout& L, const float* q, const KV* kv, float* out, int64_t b, const Row* rows, int64_t kvh,
            int64_t H, bool fetch, float* work) {
  const int64_t D = L.D, bs = L.bs, half = bs * L.kvh_count * D;
  const int32_t* table = L.table + b * L.table_width;
  constexpr float inf = std::numeric_limits<float>::infinity();
  int64_t pos[R], lo[R];
  float* acc = work;          // [R, D]
  float* qt = work + R * D;  // the rows' queries as [D, R]: a pass's broadcasts then share one pointer
  uint32_t* qp = reinterpret_cast<uint32_t*>(qt);  // or, with K in pairs, as bfloat16 pairs [D/2, R]
  for (int r = 0; r < R; ++r) {
    pos[r] = offset(L, b) + rows[r].t;
    lo[r] = L.window > 0 ? std::max<int64_t>(0, pos[r] - L.window + 1) : 0;
    const float* qr = q + (rows[r].t * H + rows[r].h) * D;
    if constexpr (Pairs)
      for (int64_t d2 = 0; d2 < D / 2; ++d2)
        qp[d2 * R + r] = uint32_t(c10::BFloat16(qr[2 * d2]).x) | uint32_t(c10::BFloat16(qr[2 * d2 + 1]).x) << 16;
    else
      for (int64_t d = 0; d < D; ++d) qt[d * R + r] = qr[d];
  }
  const int64_t first = *std::min_element(lo, lo + R) / bs, last = *std::max_element(pos, pos + R) / bs;
  auto keys_of = [&](int64_t blk) { return kv + int64_t(table[blk]) * 2 * half + kvh * D * bs; };
  auto values_of = [&](int64_t blk) { return kv + int64_t(table[blk]) * 2 * half + half + kvh * bs * D; };
  constexpr int NP = R == 1 ? 4 : R <= 3 ? 2 : 1;
  alignas(64) float s[NP][R][kPiece];
  alignas(64) float e[R][kPiece];
  alignas(64) float shift[(R + 15) / 16 * 16] = {}, alpha[(R + 15) / 16 * 16];  // lanes are rows
  std::fill(acc, acc + R * D, 0.0f);
  float m[R];
  alignas(64) float l[R][kPiece] = {};  // each row's softmax denominator, by lane
  for (int r = 0; r < R; ++r) m[r] = -inf;
  // Keys [v0, v1) of row r in the piece at `base`, and their union [u0, u1) (empty: u0 >= u1).
  struct Span {
    int64_t v0[R], v1[R], u0, u1;
  };
  auto span = [&](int64_t base, int64_t len) {
    Span k{{}, {}, len, 0};
    for (int r = 0; r < R; ++r) {
      k.v0[r] = std::clamp<int64_t>(lo[r] - base, 0, len);
      k.v1[r] = std::clamp<int64_t>(pos[r] + 1 - base, 0, len);
      if (k.v0[r] < k.v1[r]) k.u0 = std::min(k.u0, k.v0[r]), k.u1 = std::max(k.u1, k.v1[r]);
    }
    return k;
  };
  // One online-softmax step over a scored piece: e[r][j] = e^(s[r][j] - m_new) on row r's keys, 0 on the
  // rest; a row with no keys here keeps its max and gets alpha = e^0 = 1, so its sums pass through
  // unchanged. Then every row's sums and accumulators take the piece's keys.
  auto step = [&](const float (*sc)[kPiece], const Span& k, const KV* v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (Pairs) {
      // Sixteen keys to a vector, in phases over the rows so that their dependency chains overlap.
      __m512 x[R];
      __mmask16 own[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        own[r] = k.v0[r] < k.v1[r] ? __mmask16(((1u << k.v1[r]) - 1) & ~((1u << k.v0[r]) - 1)) : 0;
        x[r] = _mm512_mask_blend_ps(own[r], _mm512_set1_ps(-inf), _mm512_load_ps(sc[r]));
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(x[r]));
        shift[r] = own[r] ? m[r] - m_new : 0.0f;
        m[r] = m_new;
      }
      _mm512_store_ps(alpha, exp16(_mm512_load_ps(shift)));
      alignas(64) uint32_t ep[R][kPiece / 2];  // e rounded to bfloat16 pairs for V; the sums l keep float32
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 er = _mm512_maskz_mov_ps(own[r], exp16(_mm512_sub_ps(x[r], _mm512_set1_ps(m[r]))));
        _mm512_store_ps(l[r], _mm512_fmadd_ps(_mm512_load_ps(l[r]), _mm512_set1_ps(alpha[r]), er));
        _mm256_store_si256(reinterpret_cast<__m256i*>(ep[r]), (__m256i)_mm512_cvtneps_pbh(er));
      }
      int64_t d = 0;
      for (; D - d > 16; d += 32) piece_value_pairs<KV, R, 2>(acc, alpha, ep, v, D, k.u0, k.u1, d);
      if (d < D) piece_value_pairs<KV, R, 1>(acc, alpha, ep, v, D, k.u0, k.u1, d);
      return;
    }
#endif
    for (int r = 0; r < R; ++r) {
      if (k.v0[r] >= k.v1[r]) {
        shift[r] = 0.0f;
        _mm256_store_ps(e[r], _mm256_setzero_ps());
        _mm256_store_ps(e[r] + 8, _mm256_setzero_ps());
        continue;
      }
      const __m256i after_first = _mm256_set1_epi32(int(k.v0[r]) - 1), end = _mm256_set1_epi32(int(k.v1[r]));
      __m256 x[2];
      for (int p = 0; p < 2; ++p) {
        const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(8 * p), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 in = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(at, after_first), _mm256_cmpgt_epi32(end, at)));
        x[p] = _mm256_blendv_ps(_mm256_set1_ps(-inf), _mm256_load_ps(sc[r] + 8 * p), in);
      }
      const float m_new = std::max(m[r], hmax(_mm256_max_ps(x[0], x[1])));
      const __m256 mn = _mm256_set1_ps(m_new);
      for (int p = 0; p < 2; ++p) _mm256_store_ps(e[r] + 8 * p, exp8(_mm256_sub_ps(x[p], mn)));
      shift[r] = m[r] - m_new;
      m[r] = m_new;
    }
    // Every row's rescale e^(m_old - m_new) from vector exps (lanes are rows; each lane's value is the one
    // a lone row gets).
    for (int i = 0; i < R; i += 8) _mm256_store_ps(alpha + i, exp8(_mm256_load_ps(shift + i)));
    for (int r = 0; r < R; ++r)
      _mm256_store_ps(l[r], _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(l[r]), _mm256_set1_ps(alpha[r])),
                                                        _mm256_load_ps(e[r])),
                                          _mm256_load_ps(e[r] + 8)));
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) piece_values<KV, R, 2>(acc, alpha, e, v, D, k.u0, k.u1, d);
    for (; d + 8 <= D; d += 8) piece_values<KV, R, 1>(acc, alpha, e, v, D, k.u0, k.u1, d);
    for (; d < D; ++d)
      for (int r = 0; r < R; ++r) {
        float a = acc[r * D + d] * alpha[r];
        for (int64_t j = k.u0; j < k.u1; ++j) a = std::fma(e[r][j], load1(v + j * D + d), a);
        acc[r * D + d] = a;
      }
  };
  // Pieces with keys are scored NP at a time, then stepped through in order. A piece's lanes past its
  // keys read on into the cache (the next K^T row, or the block's V half): finite or not, they are masked.
  const KV* kts[NP];
  const KV* vs[NP];
  Span spans[NP];
  int queued = 0;
  auto score = [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (Pairs) {
      if (queued == NP) return piece_score_pairs<KV, R, NP>(qp, kts, bs, D, L.scale, s);
      for (int i = 0; i < queued; ++i) piece_score_pairs<KV, R, 1>(qp, kts + i, bs, D, L.scale, s + i);
      return;
    }
#endif
    if (queued == NP) return piece_scores<KV, R, NV, NP>(qt, kts, bs, D, L.scale, s);
    for (int i = 0; i < queued; ++i) piece_scores<KV, R, NV, 1>(qt, kts + i, bs, D, L.scale, s + i);
  };
  auto flush = [&]() {
    if (bs >= kPiece)
      score(std::integral_constant<int, 2>{});
    else
      score(std::integral_constant<int, 1>{});
    for (int i = 0; i < queued; ++i) step(s[i], spans[i], vs[i]);
    queued = 0;
  };
  // An item's first rows fetch the blocks; its later rows find them in L2.
  if (fetch)
    for (int64_t blk = first; blk < std::min(first + kAhead, last + 1); ++blk)
      prefetch_block(keys_of(blk), values_of(blk), bs * D);
  for (int64_t blk = first; blk <= last; ++blk) {
    if (fetch && blk + kAhead <= last) prefetch_block(keys_of(blk + kAhead), values_of(blk + kAhead), bs * D);
    for (int64_t c0 = 0; c0 < bs; c0 += kPiece) {
      const Span k = span(blk * bs + c0, std::min(kPiece, bs - c0));
      if (k.u0 >= k.u1) continue;
      kts[queued] = keys_of(blk) + (Pairs ? 2 : 1) * c0, vs[queued] = values_of(blk) + c0 * D, spans[queued] = k;
      if (++queued == NP) flush();
    }
  }
  flush();
  for (int r = 0; r < R; ++r) {
    float* o = out + (rows[r].t * H + rows[r].h) * D;
    // The pair path sums sixteen lanes; the other path's upper eight stay zero (+ 0 changes nothing).
    const float inv = 1.0f / (hsum(_mm256_load_ps(l[r])) + hsum(_mm256_load_ps(l[r] + 8)));
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// attend on AMX tiles, for the pair layout with block_size and D multiples of 32. A pass holds up to 32
// rows: one row tile (R <= 16) or two (16 and R - 16), which share every K and V tile load. The queries
// carry the scale and log2(e), so the scores come out in base 2 and the softmax takes 2^x (two fewer
// multiplies and a shorter exponential per score). The online softmax steps over spans of 64 positions
// at fixed offsets (0, 64, ...): per span, each 16-key piece's scores for a row tile are one C tile (Q by
// K^T, 32 d per tile multiply), the softmax runs on them in vectors, and e in bfloat16 pairs times V (32
// keys per tile multiply) adds into the rows' float32 accumulators, which the C tiles load and store
// whole. A row's weights are e = 2^(x - m) against a reference max m that moves only when a score passes
// it by more than kSlack (always on the row's first keys): then the row's sums and accumulators are
// rescaled once, and otherwise never, so most spans add into the accumulators with no vector work. The
// result is the same softmax; e stays below 2^kSlack. A span's values are multiplied after the next
// span's scores, so the tiles work while the vectors do the softmax. A value tile loads all of its keys:
// keys outside every row's span are zeroed in a copy of V first (an unwritten slot's bits need not be a
// number). Every pass runs this way, and a row's reference max depends on its own scores alone, so its
// result never depends on the rows beside it.
constexpr int64_t kSpan = 64;     // positions per online-softmax step on tiles: four pieces
constexpr int64_t kKeyTile = 32;  // keys per value tile multiply: 16 pairs
constexpr float kSlack = 8.0f;
// attend_amx's work, in floats per unit of D: accumulators [32, D], queries as pairs [32, D/2], two
// spans' V copies as pair rows [2][kSpan / 2][D].
constexpr int64_t kTileWork = 32 + 16 + kSpan;

bool amx_attention(int64_t bs, int64_t D) { return amx() && bs % kKeyTile == 0 && D % 32 == 0; }

// NT row tiles: R rows, 1-16 (NT = 1) or 17-32 (NT = 2). Tiles: tmm0-1 A (a row tile's queries, or its
// e), tmm2-3 B (K^T or V), tmm4-7 C (scores, or accumulators): NT = 1 uses tmm4-7 for four pieces or
// four 16-d tiles, NT = 2 tmm4-5 for row tile 0 and tmm6-7 for row tile 1, two of each at a time.
template <int NT>
void attend_amx(const Layout& L, const float* q, const c10::BFloat16* kv, float* out, int64_t b, const Row* rows,
                int R, int64_t kvh, int64_t H, bool fetch, float* work) {
  const int64_t D = L.D, bs = L.bs, half = bs * L.kvh_count * D, D2 = D / 2, DT = D / 16;
  const int32_t* table = L.table + b * L.table_width;
  constexpr float inf = std::numeric_limits<float>::infinity();
  constexpr int P = kSpan / kPiece, KT = kSpan / kKeyTile, G = 4 / NT;  // G: C tiles per row tile
  configure_tiles(NT == 1 ? R : 16, NT == 1 ? 0 : R - 16);
  float* acc = work;  // [NT][D/16][16][16]: a row tile's 16-d accumulator tiles, as C tiles hold them
  uint32_t* qp = reinterpret_cast<uint32_t*>(work + 32 * D);  // the rows' queries as bfloat16 pairs [32, D/2]
  uint32_t* vz = qp + 32 * D2;                                // [2][kSpan / 2][D]: V copies with keys zeroed
  const float scale = L.scale * 1.44269504088896341f;
  int64_t pos[32], lo[32];
  float m[32];
  alignas(64) float l[32][16] = {}, s[NT][P][16][16];
  alignas(64) c10::BFloat16 ep[2][NT][16][kSpan];  // e, by row tile: its rows' weights for the span's keys
  for (int r = 0; r < R; ++r) {
    pos[r] = offset(L, b) + rows[r].t;
    lo[r] = L.window > 0 ? std::max<int64_t>(0, pos[r] - L.window + 1) : 0;
    m[r] = -inf;
    const float* qr = q + (rows[r].t * H + rows[r].h) * D;
    for (int64_t d = 0; d < D; d += 16)  // round to nearest even, as c10::BFloat16
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + r * D2 + d / 2),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + d), _mm512_set1_ps(scale))));
  }
  std::fill(acc, acc + NT * 16 * D, 0.0f);
  const int64_t lo_min = *std::min_element(lo, lo + R), pos_max = *std::max_element(pos, pos + R);
  auto keys_of = [&](int64_t blk) { return kv + int64_t(table[blk]) * 2 * half + kvh * D * bs; };
  auto values_of = [&](int64_t blk) { return kv + int64_t(table[blk]) * 2 * half + half + kvh * bs * D; };
  const int64_t last = pos_max / bs;
  if (fetch)
    for (int64_t blk = lo_min / bs; blk < std::min(lo_min / bs + kAhead, last + 1); ++blk)
      prefetch_block(keys_of(blk), values_of(blk), bs * D);
  // A span's values wait for the next span's scores: the tile multiplies of one run while the vector
  // softmax of the other does. Its value tiles (keys' bits, V or a copy) and which e buffer:
  struct Values {
    uint32_t used[KT];
    const uint32_t* v[KT];
    int buf;
  };
  Values pending;
  bool waiting = false;
  int cur = 0;  // which of the double buffers (ep, vz) this span fills
  // The accumulators' 16-d tiles, G per row tile at a time: loaded, the span's e by V added, stored.
  auto values = [&](const Values& w) {
    compiler_fence();
    for (int64_t d0 = 0; d0 < DT; d0 += G) {
      const int n = int(std::min<int64_t>(G, DT - d0));
      float* a0 = acc + d0 * 256;
      float* a1 = acc + (DT + d0) * 256;  // row tile 1's
      if constexpr (NT == 1) {
        _tile_loadd(4, a0, 64);
        if (n > 1) _tile_loadd(5, a0 + 256, 64);
        if (n > 2) _tile_loadd(6, a0 + 512, 64);
        if (n > 3) _tile_loadd(7, a0 + 768, 64);
        for (int j = 0; j < KT; ++j) {
          if (!w.used[j]) continue;
          const uint32_t* v = w.v[j] + 16 * d0;
          _tile_loadd(0, &ep[w.buf][0][0][kKeyTile * j], kSpan * 2);
          _tile_loadd(2, v, D * 4); _tile_dpbf16ps(4, 0, 2);
          if (n > 1) { _tile_loadd(3, v + 16, D * 4); _tile_dpbf16ps(5, 0, 3); }
          if (n > 2) { _tile_loadd(2, v + 32, D * 4); _tile_dpbf16ps(6, 0, 2); }
          if (n > 3) { _tile_loadd(3, v + 48, D * 4); _tile_dpbf16ps(7, 0, 3); }
        }
        _tile_stored(4, a0, 64);
        if (n > 1) _tile_stored(5, a0 + 256, 64);
        if (n > 2) _tile_stored(6, a0 + 512, 64);
        if (n > 3) _tile_stored(7, a0 + 768, 64);
      } else {
        _tile_loadd(4, a0, 64); _tile_loadd(6, a1, 64);
        if (n > 1) { _tile_loadd(5, a0 + 256, 64); _tile_loadd(7, a1 + 256, 64); }
        for (int j = 0; j < KT; ++j) {
          if (!w.used[j]) continue;
          const uint32_t* v = w.v[j] + 16 * d0;
          _tile_loadd(0, &ep[w.buf][0][0][kKeyTile * j], kSpan * 2);
          _tile_loadd(1, &ep[w.buf][1][0][kKeyTile * j], kSpan * 2);
          _tile_loadd(2, v, D * 4); _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(6, 1, 2);
          if (n > 1) { _tile_loadd(3, v + 16, D * 4); _tile_dpbf16ps(5, 0, 3); _tile_dpbf16ps(7, 1, 3); }
        }
        _tile_stored(4, a0, 64); _tile_stored(6, a1, 64);
        if (n > 1) { _tile_stored(5, a0 + 256, 64); _tile_stored(7, a1 + 256, 64); }
      }
    }
    compiler_fence();
  };
  for (int64_t base = lo_min / kSpan * kSpan; base <= pos_max; base += kSpan) {
    auto below = [](int64_t n) { return n >= 64 ? ~0ull : (1ull << n) - 1; };  // bits [0, n)
    uint64_t own[32], any = 0;  // each row's positions in the span, and their union
    for (int r = 0; r < R; ++r) {
      const int64_t v0 = std::clamp<int64_t>(lo[r] - base, 0, kSpan), v1 = std::clamp<int64_t>(pos[r] + 1 - base, 0, kSpan);
      own[r] = below(v1) & ~below(v0);
      any |= own[r];
    }
    if (!any) continue;
    bool used[P];
    const c10::BFloat16* kt[P];
    for (int j = 0; j < P; ++j) {
      used[j] = (any >> (kPiece * j)) & 0xFFFF;
      const int64_t at = base + kPiece * j, blk = at / bs, c0 = at % bs;
      if (fetch && c0 == 0 && blk + kAhead <= last) prefetch_block(keys_of(blk + kAhead), values_of(blk + kAhead), bs * D);
      if (used[j]) kt[j] = keys_of(blk) + 2 * c0;
    }
    // Each piece's score tile sums its d slices in order.
    compiler_fence();
    if constexpr (NT == 1) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t d0 = 0; d0 < D2; d0 += 16) {
        _tile_loadd(0, qp + d0, D2 * 4);
        if (used[0]) { _tile_loadd(2, kt[0] + d0 * bs * 2, bs * 4); _tile_dpbf16ps(4, 0, 2); }
        if (used[1]) { _tile_loadd(3, kt[1] + d0 * bs * 2, bs * 4); _tile_dpbf16ps(5, 0, 3); }
        if (used[2]) { _tile_loadd(2, kt[2] + d0 * bs * 2, bs * 4); _tile_dpbf16ps(6, 0, 2); }
        if (used[3]) { _tile_loadd(3, kt[3] + d0 * bs * 2, bs * 4); _tile_dpbf16ps(7, 0, 3); }
      }
      if (used[0]) _tile_stored(4, s[0][0], 64);
      if (used[1]) _tile_stored(5, s[0][1], 64);
      if (used[2]) _tile_stored(6, s[0][2], 64);
      if (used[3]) _tile_stored(7, s[0][3], 64);
    } else {
      for (int j = 0; j < P; j += 2) {  // two pieces for both row tiles at a time
        if (!used[j] && !used[j + 1]) continue;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (int64_t d0 = 0; d0 < D2; d0 += 16) {
          _tile_loadd(0, qp + d0, D2 * 4);
          _tile_loadd(1, qp + 16 * D2 + d0, D2 * 4);
          if (used[j]) { _tile_loadd(2, kt[j] + d0 * bs * 2, bs * 4); _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(6, 1, 2); }
          if (used[j + 1]) { _tile_loadd(3, kt[j + 1] + d0 * bs * 2, bs * 4); _tile_dpbf16ps(5, 0, 3); _tile_dpbf16ps(7, 1, 3); }
        }
        if (used[j]) { _tile_stored(4, s[0][j], 64); _tile_stored(6, s[1][j], 64); }
        if (used[j + 1]) { _tile_stored(5, s[0][j + 1], 64); _tile_stored(7, s[1][j + 1], 64); }
      }
    }
    if (waiting) values(pending);
    compiler_fence();
    // Each row's e = 2^(x - m) for its keys (0 on the rest, and on pieces no row has, which a value tile
    // may still load), after moving m if a score passed it by more than kSlack.
    // A row that owns the whole span (most spans of a long context) has no lanes to mask and no -inf.
    auto softmax_row = [&]<bool Whole>(int r) {
      const int t = r / 16, i = r % 16;
      __m512 x[P];
      __m512 top = _mm512_set1_ps(-inf);
      for (int j = 0; j < P; ++j) {
        if (!Whole && !used[j]) continue;
        x[j] = _mm512_load_ps(s[t][j][i]);
        if constexpr (!Whole) x[j] = _mm512_mask_blend_ps(__mmask16(own[r] >> (kPiece * j)), _mm512_set1_ps(-inf), x[j]);
        top = _mm512_max_ps(top, x[j]);
      }
      __m512 sum = _mm512_load_ps(l[r]);
      if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m[r] + kSlack), _CMP_GT_OQ)) {
        const float m_new = _mm512_reduce_max_ps(top);
        if (m[r] > -inf) {  // before its first keys, a row's sums are zero
          const __m512 alpha = exp2_16<true>(_mm512_set1_ps(m[r] - m_new));
          sum = _mm512_mul_ps(sum, alpha);
          for (int64_t c = 0; c < DT; ++c) {
            float* a = acc + ((t * DT + c) * 16 + i) * 16;
            _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), alpha));
          }
        }
        m[r] = m_new;
      }
      __m512 e[P];
      for (int j = 0; j < P; ++j) {
        e[j] = _mm512_setzero_ps();
        if (!Whole && !used[j]) continue;
        e[j] = exp2_16<Whole>(_mm512_sub_ps(x[j], _mm512_set1_ps(m[r])));
        if constexpr (!Whole) e[j] = _mm512_maskz_mov_ps(__mmask16(own[r] >> (kPiece * j)), e[j]);
        sum = _mm512_add_ps(sum, e[j]);
      }
      for (int j = 0; j < P; j += 2)  // two pieces' e rounded by one instruction
        _mm512_store_si512(ep[cur][t][i] + kPiece * j, (__m512i)_mm512_cvtne2ps_pbh(e[j + 1], e[j]));
      _mm512_store_ps(l[r], sum);
    };
    for (int r = 0; r < R; ++r) {
      if (own[r] == ~0ull) softmax_row.template operator()<true>(r);
      else softmax_row.template operator()<false>(r);
    }
    // Value tiles: keys outside every row's span are zeroed in a copy of V.
    Values next;
    next.buf = cur;
    for (int j = 0; j < KT; ++j) {
      const int64_t at = base + kKeyTile * j;
      const uint32_t in = uint32_t(any >> (kKeyTile * j));
      next.used[j] = in;
      if (!in) continue;
      next.v[j] = reinterpret_cast<const uint32_t*>(values_of(at / bs) + at % bs * D);
      if (in == ~0u) continue;
      uint32_t* copy = vz + (cur * KT + j) * kKeyTile / 2 * D;
      for (int64_t p = 0; p < kKeyTile / 2; ++p) {
        const uint32_t keep = ((in >> 2 * p) & 1 ? 0xFFFFu : 0u) | ((in >> (2 * p + 1)) & 1 ? 0xFFFF0000u : 0u);
        const __m512i k = _mm512_set1_epi32(int(keep));
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_si512(copy + p * D + d, _mm512_and_si512(k, _mm512_loadu_si512(next.v[j] + p * D + d)));
      }
      next.v[j] = copy;
    }
    pending = next;
    waiting = true;
    cur ^= 1;
  }
  if (waiting) values(pending);
  for (int r = 0; r < R; ++r) {
    const int t = r / 16, i = r % 16;
    float* out_r = out + (rows[r].t * H + rows[r].h) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / (hsum(_mm256_load_ps(l[r])) + hsum(_mm256_load_ps(l[r] + 8))));
    for (int64_t c = 0; c < DT; ++c)
      _mm512_storeu_ps(out_r + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + ((t * DT + c) * 16 + i) * 16), inv));
  }
}
#else
bool amx_attention(int64_t, int64_t) { return false; }
constexpr int64_t kTileWork = 0;
#endif


template <typename KV, bool Pairs, size_t... I>
constexpr auto attend_table(std::index_sequence<I...>) {
  return std::array{&attend<KV, int(I) + 1, Pairs>...};
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// The blocks B requests read (their tables' first ceil(seq_len / bs) columns) widened from fp8 to bfloat16,
// each once, in order of first use; `table` gets the requests' tables renumbered to the copy (width as L's).
template <typename KV>
at::Tensor widen_blocks(const KV* kv, const Layout& L, int64_t B, int64_t cache_blocks, std::vector<int32_t>& table) {
  std::vector<int32_t> slot(cache_blocks, -1), used;
  table.assign(L.table, L.table + B * L.table_width);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < (L.seq_lens[b] + L.bs - 1) / L.bs; ++j) {
      int32_t& at = table[b * L.table_width + j];
      if (slot[at] < 0) slot[at] = int32_t(used.size()), used.push_back(at);
      at = slot[at];
    }
  const int64_t block = 2 * L.bs * L.kvh_count * L.D;  // values per block, a multiple of 32 (bs of 8, D even)
  at::Tensor out = at::empty({int64_t(used.size()), block}, at::TensorOptions().dtype(at::kBFloat16));
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, int64_t(used.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t e = 0; e < block; e += 32)
        _mm512_storeu_si512(dst + i * block + e, (__m512i)pairs32(kv + int64_t(used[i]) * block + e));
  });
  return out;
}
#endif

// q [T, H, D] float32; kv_cache [blocks, 2, bs, KVH, D] in the layout above; query_start_loc [B+1],
// seq_lens [B] and block_table [B, W] int32. Each request's rows are its last q_len positions; rows past
// the last request (padding) are zero.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                           int64_t sliding_window, bool pairs) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && q_in.dim() == 3, "kiln_cpu::paged_attention: q must be [T, H, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kiln_cpu::paged_attention: kv_cache must be [blocks, 2, block_size, KVH, D]");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "kiln_cpu::paged_attention: int32 layout tensors");
  at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "kiln_cpu::paged_attention: head shapes do not match");
  TORCH_CHECK(kv_cache.size(2) % 8 == 0, "kiln_cpu::paged_attention: block_size must be a multiple of 8");
  const int64_t B = seq_lens.size(0);
  Layout L{query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
           block_table.size(1), kv_cache.size(2), KVH, D, H / KVH, float(scale), sliding_window};
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(!pairs || (kBf16Dot && D % 2 == 0 &&
                         (dtype == at::kBFloat16 || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2)),
              "kiln_cpu::paged_attention: pairs need a bfloat16 or fp8 cache, an even head dim and AVX512-BF16");
  // Every request row is written below; only the padding rows past the last request need zeros.
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t used_rows = std::min<int64_t>(L.qsl[B], T);
  out.narrow(0, used_rows, T - used_rows).zero_();
  // Groups of consecutive rows of one request, as many as fill a pass with the group's heads:
  // (request, first row, rows), request by request (request b's are [first[b], first[b + 1])).
  const bool tiles = pairs && dtype == at::kBFloat16 && amx_attention(L.bs, D);  // an fp8 cache's pass is vectors
  const int64_t pass_rows = tiles ? 32 : kPassRows;
  const int64_t span = std::max<int64_t>(1, pass_rows / L.group);
  std::vector<std::array<int64_t, 3>> groups;
  std::vector<int64_t> first(B + 1), requests;
  for (int64_t b = 0; b < B; ++b) {
    first[b] = int64_t(groups.size());
    const int64_t end = std::min<int64_t>(L.qsl[b + 1], T);
    for (int64_t t = L.qsl[b]; t < end; t += span) groups.push_back({b, t, std::min<int64_t>(span, end - t)});
    if (int64_t(groups.size()) > first[b]) requests.push_back(b);
  }
  first[B] = int64_t(groups.size());
  const int64_t n = first[B];
  // Work items: (group, kv heads, part), a kv head's query heads together, or one at a time (parts) when
  // that is too few items to keep every thread busy (a decode of one sequence). Threads take them one at
  // a time, the longest contexts first: split evenly, a causal prefill's later (longer) rows would all
  // land on the last thread. So requests go in the order of their longest (last) group, and within one,
  // its groups from the last. A request of several groups (a prefill chunk) takes its kv heads one after
  // another, each over all its groups, so a thread's next item reads the K/V its last one left in L2 (a
  // 7,900-token context's, one head's, fills it). Where there are items enough, a request of one group (a
  // decode) is one item over all its kv heads: a thread then reads each block's heads in address order,
  // which the hardware's streamer follows (batch-64 decode attention about 8% faster than head by head).
  const int64_t threads = at::get_num_threads();
  const int64_t split = n * KVH < 4 * threads ? L.group : 1;
  const bool whole = n >= 4 * threads;
  const int64_t per = L.group / split;
  auto context = [&](int64_t g) { return offset(L, groups[g][0]) + groups[g][1] + groups[g][2]; };
  std::stable_sort(requests.begin(), requests.end(),
                   [&](int64_t x, int64_t y) { return context(first[x + 1] - 1) > context(first[y + 1] - 1); });
  std::vector<std::array<int64_t, 4>> order;  // (group, first kv head, last kv head + 1, part)
  order.reserve(n * KVH * split);
  for (int64_t b : requests) {
    if (whole && first[b + 1] - first[b] == 1) {
      order.push_back({first[b], 0, KVH, 0});
      continue;
    }
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t g = first[b + 1] - 1; g >= first[b]; --g)
        for (int64_t part = 0; part < split; ++part) order.push_back({g, kvh, kvh + 1, part});
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t items = int64_t(order.size());
  auto run = [&](auto* kv, auto in_pairs) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kv)>>;
    static constexpr auto passes = attend_table<KV, decltype(in_pairs)::value>(std::make_index_sequence<kPassRows>{});
#pragma omp parallel num_threads(int(std::max<int64_t>(1, std::min<int64_t>(threads, items))))
    {
      std::vector<float> work(std::max<int64_t>(2 * kPassRows, kTileWork) * D);  // a pass's scratch
      std::vector<Row> rows(span * L.group);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < items; ++i) {
        const auto [gi, kvh0, kvh1, part] = order[i];
        const auto [b, t0, n_rows] = groups[gi];
        const int64_t g0 = part * per, g1 = g0 + per;
        // A request of one group (a decode) reads its blocks once, so its first pass prefetches them. A
        // longer chunk's groups share its blocks, which stay in L2 from one group to the next: there the
        // prefetches were a third of the kernel's time.
        const bool alone = L.qsl[b + 1] - L.qsl[b] <= span;
        for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
          // The item's rows, position by position, attended pass_rows at a time.
          int64_t count = 0;
          for (int64_t r = 0; r < n_rows; ++r)
            for (int64_t g = g0; g < g1; ++g) rows[count++] = {t0 + r, kvh * L.group + g};
          for (int64_t r0 = 0; r0 < count; r0 += pass_rows) {
            const int64_t pass = std::min<int64_t>(pass_rows, count - r0);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if constexpr (std::is_same_v<KV, c10::BFloat16> && decltype(in_pairs)::value)
              if (tiles) {
                (pass > 16 ? attend_amx<2> : attend_amx<1>)(L, qp, kv, op, b, rows.data() + r0, int(pass), kvh, H,
                                                            alone && r0 == 0, work.data());
                continue;
              }
#endif
            passes[pass - 1](L, qp, kv, op, b, rows.data() + r0, kvh, H, alone && r0 == 0, work.data());
          }
        }
      }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles) _tile_release();
#endif
    }
  };
  // An fp8 cache under a prefill chunk (a request of more rows than a pass takes): each of the chunk's passes
  // would widen every block it reads, so the blocks the call reads are widened to bfloat16 once, into a copy
  // in the same layout, and the pairs run on it: the same values, so the same bits as reading fp8 directly.
  at::Tensor widened;
  std::vector<int32_t> table;
  auto either = [&](auto* kv) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kv)>>;
    if constexpr (!std::is_same_v<KV, c10::BFloat16>) {
      bool chunked = false;
      for (int64_t b = 0; b < B; ++b) chunked |= L.qsl[b + 1] - L.qsl[b] > span;
      if (pairs && chunked) {
        widened = widen_blocks(kv, L, B, kv_cache.size(0), table);
        L.table = table.data();
        return run(widened.data_ptr<c10::BFloat16>(), std::true_type{});
      }
    }
    if (pairs) return run(kv, std::true_type{});
#endif
    run(kv, std::false_type{});
  };
  switch (dtype) {
    case at::kHalf: run(kv_cache.data_ptr<c10::Half>(), std::false_type{}); break;
    case at::kBFloat16: either(kv_cache.data_ptr<c10::BFloat16>()); break;
    case at::kFloat: run(kv_cache.data_ptr<float>(), std::false_type{}); break;
    case at::kFloat8_e4m3fn: either(kv_cache.data_ptr<c10::Float8_e4m3fn>()); break;
    case at::kFloat8_e5m2: either(kv_cache.data_ptr<c10::Float8_e5m2>()); break;
    default: TORCH_CHECK(false, "kiln_cpu::paged_attention: kv_cache must be float32, float16, bfloat16 or fp8");
  }
  return out;
}
