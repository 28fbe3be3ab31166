// Writing new tokens' K and V into the KV cache's slots, in attention.h's layout.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

// x in the cache's dtype. fp8 saturates at its largest finite value, as vLLM's writers do (e4m3 has no
// infinity, and c10's conversion makes NaN of what lies beyond).
template <typename KV>
inline KV to_cache(float x) {
  if constexpr (std::is_same_v<KV, c10::Float8_e4m3fn> || std::is_same_v<KV, c10::Float8_e5m2>) {
    const float limit = static_cast<float>(std::numeric_limits<KV>::max());
    return KV(std::clamp(x, -limit, limit));
  }
  return KV(x);
}

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
          for (int64_t d = 0; d < D; ++d) kh[d * bs + at] = to_cache<KV>(kr[d]);
          for (int64_t d = 0; d < D; ++d) vh[at * D + d] = to_cache<KV>(vr[d]);
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
  switch (kv_cache.scalar_type()) {
    case at::kHalf: write_slots(k, v, kv_cache.data_ptr<c10::Half>(), slots, bs, false); break;
    case at::kBFloat16: write_slots(k, v, kv_cache.data_ptr<c10::BFloat16>(), slots, bs, pairs); break;
    case at::kFloat: write_slots(k, v, kv_cache.data_ptr<float>(), slots, bs, false); break;
    case at::kFloat8_e4m3fn: write_slots(k, v, kv_cache.data_ptr<c10::Float8_e4m3fn>(), slots, bs, false); break;
    case at::kFloat8_e5m2: write_slots(k, v, kv_cache.data_ptr<c10::Float8_e5m2>(), slots, bs, false); break;
    default: TORCH_CHECK(false, "kiln_cpu::write_kv: kv_cache must be float32, float16, bfloat16 or fp8");
  }
}
