// Writing new tokens' K and V into the KV cache's slots, in attention.h's layout.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

// The fp8 formats' mantissa bits and exponent bias.
template <typename KV>
struct Fp8 {
  static constexpr bool kIs = false;
};
template <>
struct Fp8<c10::Float8_e4m3fn> {
  static constexpr bool kIs = true;
  static constexpr int kMantissa = 3, kBias = 7;
};
template <>
struct Fp8<c10::Float8_e5m2> {
  static constexpr bool kIs = true;
  static constexpr int kMantissa = 2, kBias = 15;
};

// n floats as fp8 bytes, rounded to nearest even and saturating at the largest finite value, as
// kiln.ops.attention.to_cache and vLLM's writers do (e4m3 has no infinity, and c10's conversion makes NaN of
// what lies beyond). With AVX-512, sixteen at a time:
// a normal value drops its extra mantissa bits (adding half an ulp, less one unless the kept part is odd;
// a carry moves the exponent up) and is rebiased; a smaller one is its multiple of the smallest subnormal,
// rounded to nearest even by the conversion.
template <typename KV>
inline void to_fp8(const float* x, uint8_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  constexpr int M = Fp8<KV>::kMantissa, B = Fp8<KV>::kBias, drop = 23 - M;
  const __m512 top = _mm512_set1_ps(static_cast<float>(std::numeric_limits<KV>::max()));
  const __m512 smallest_normal = _mm512_set1_ps(std::ldexp(1.0f, 1 - B));
  const __m512 per_subnormal = _mm512_set1_ps(std::ldexp(1.0f, B - 1 + M));
  for (; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(v), top);
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, drop), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32((1 << (drop - 1)) - 1), odd));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(up, drop), _mm512_set1_epi32((127 - B) << M));
    const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, per_subnormal));
    const __mmask16 small = _mm512_cmp_ps_mask(a, smallest_normal, _CMP_LT_OQ);
    const __m512i code = _mm512_or_si512(_mm512_mask_mov_epi32(normal, small, sub), sign);
    _mm_mask_storeu_epi8(out + i, lanes, _mm512_cvtepi32_epi8(code));
  }
#endif
  const float limit = static_cast<float>(std::numeric_limits<KV>::max());
  for (; i < n; ++i) out[i] = KV(std::clamp(x[i], -limit, limit)).x;
}

constexpr int64_t kMaxFp8HeadDim = 1024;

// k, v [T, KVH, D] float32 (rows may be strided) into the cache's slots (slot_mapping [T] int64; -1 is
// padding, not written), in attention.h's layout, rounded to the cache's dtype. Slots are distinct, so tokens
// are written in parallel.
template <typename KV>
void write_slots(const at::Tensor& k, const at::Tensor& v, KV* cache, const int64_t* slots, int64_t bs, bool pairs) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), half = bs * KVH * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t skt = k.stride(0), skh = k.stride(1), svt = v.stride(0), svh = v.stride(1);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t at = slots[t] % bs;
      KV* kb = cache + slots[t] / bs * 2 * half;
      KV* vb = kb + half;
      for (int64_t h = 0; h < KVH; ++h) {
        const float* kr = kp + t * skt + h * skh;
        const float* vr = vp + t * svt + h * svh;
        KV* kh = kb + h * D * bs;
        KV* vh = vb + h * bs * D;
        if constexpr (Fp8<KV>::kIs) {  // the row's bytes, then placed as the other dtypes' values are
          uint8_t kf[kMaxFp8HeadDim], vf[kMaxFp8HeadDim];
          to_fp8<KV>(kr, kf, D);
          to_fp8<KV>(vr, vf, D);
          uint8_t* k8 = reinterpret_cast<uint8_t*>(kh);
          uint8_t* v8 = reinterpret_cast<uint8_t*>(vh);
          for (int64_t d = 0; d < D; ++d) {
            if (pairs) {
              k8[(d / 2) * 2 * bs + at * 2 + d % 2] = kf[d];
              v8[(at / 2) * 2 * D + d * 2 + at % 2] = vf[d];
            } else {
              k8[d * bs + at] = kf[d];
              v8[at * D + d] = vf[d];
            }
          }
          continue;
        }
        if (pairs) {  // K[h, d / 2, at, d % 2], V[h, at / 2, d, at % 2]
          int64_t d0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
          if constexpr (std::is_same_v<KV, c10::BFloat16>) {
            // Sixteen d at a time, rounded as c10::BFloat16 does: K's eight pair words (bs words apart) by a
            // scatter; V's halves of pair words by a masked store, which leaves the other key's (another
            // thread may be writing it) untouched.
            const __m256i apart = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(bs)));
            const __mmask32 mine = at % 2 ? 0xAAAAAAAAu : 0x55555555u;
            for (; d0 + 16 <= D; d0 += 16) {
              const __m256i kw = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(kr + d0));
              _mm256_i32scatter_epi32(reinterpret_cast<int*>(kh) + (d0 / 2) * bs + at, apart, kw, 4);
              const __m512i vw = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(vr + d0)));
              _mm512_mask_storeu_epi16(vh + (at / 2) * 2 * D + d0 * 2, mine, at % 2 ? _mm512_slli_epi32(vw, 16) : vw);
            }
          }
#endif
          for (int64_t d = d0; d < D; ++d) kh[(d / 2) * 2 * bs + at * 2 + d % 2] = KV(kr[d]);
          for (int64_t d = d0; d < D; ++d) vh[(at / 2) * 2 * D + d * 2 + at % 2] = KV(vr[d]);
        } else {  // K^T[h, d, at], V[h, at, d]
          for (int64_t d = 0; d < D; ++d) kh[d * bs + at] = KV(kr[d]);
          for (int64_t d = 0; d < D; ++d) vh[at * D + d] = KV(vr[d]);
        }
      }
    }
  });
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping, bool pairs) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && k.sizes() == v.sizes() &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "kiln_cpu::write_kv: k and v must be [T, KVH, D] float32 with contiguous rows");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous() && kv_cache.size(3) == k.size(1) &&
                  kv_cache.size(4) == k.size(2),
              "kiln_cpu::write_kv: kv_cache must be [blocks, 2, block_size, KVH, D] for k's heads");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == k.size(0),
              "kiln_cpu::write_kv: slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t bs = kv_cache.size(2);
  TORCH_CHECK(kv_cache.element_size() > 1 || k.size(2) <= kMaxFp8HeadDim,
              "kiln_cpu::write_kv: an fp8 cache's head dim must be at most ", kMaxFp8HeadDim);
  switch (kv_cache.scalar_type()) {
    case at::kHalf: write_slots(k, v, kv_cache.data_ptr<c10::Half>(), slots, bs, false); break;
    case at::kBFloat16: write_slots(k, v, kv_cache.data_ptr<c10::BFloat16>(), slots, bs, pairs); break;
    case at::kFloat: write_slots(k, v, kv_cache.data_ptr<float>(), slots, bs, false); break;
    case at::kFloat8_e4m3fn: write_slots(k, v, kv_cache.data_ptr<c10::Float8_e4m3fn>(), slots, bs, pairs); break;
    case at::kFloat8_e5m2: write_slots(k, v, kv_cache.data_ptr<c10::Float8_e5m2>(), slots, bs, pairs); break;
    default: TORCH_CHECK(false, "kiln_cpu::write_kv: kv_cache must be float32, float16, bfloat16 or fp8");
  }
}
