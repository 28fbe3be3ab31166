// Vector helpers the other parts share: weights widened to float32, and e^x for eight or sixteen lanes.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

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
// fp8 KV-cache values (--kv-cache-dtype fp8) through half's bits, for F16C's conversion. e5m2 is half's top
// byte. e4m3's exponent and mantissa, shifted to half's places, read as half's with a bias of 15, not 7: the
// result is x 2^-8, exactly, subnormals included.
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i h = _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
template <typename T>
inline float load1(const T* p) { return static_cast<float>(*p); }

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// Thirty-two cache values as bfloat16 (a pair layout's sixteen pairs), for the pair dot products; with a mask,
// lanes outside it are zero. fp8 widens exactly (every e4m3 and e5m2 value is a bfloat16): a normal one by
// moving its exponent and mantissa under bfloat16's and rebiasing, a subnormal one from a table.
inline __m512bh pairs32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh pairs32(const c10::BFloat16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}
template <int Mantissa, int Rebias>
inline __m512bh widen_fp8(__m256i bytes, __m512i subnormals) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 7 - Mantissa), _mm512_set1_epi16(Rebias << 7));
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(1 << Mantissa));
  const __m512i value = _mm512_mask_permutexvar_epi16(normal, sub, mag, subnormals);
  return (__m512bh)_mm512_or_si512(value, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}
// bfloat16 bits of m * 2^-9 (e4m3) and m * 2^-16 (e5m2), m the subnormal's mantissa.
inline __m512bh widen(const c10::Float8_e4m3fn*, __m256i bytes) {
  return widen_fp8<3, 120>(bytes, _mm512_setr_epi64(0x3BC03B803B000000ll, 0x3C603C403C203C00ll, 0, 0, 0, 0, 0, 0));
}
inline __m512bh widen(const c10::Float8_e5m2*, __m256i bytes) {
  return widen_fp8<2, 112>(bytes, _mm512_setr_epi64(0x3840380037800000ll, 0, 0, 0, 0, 0, 0, 0));
}
template <typename KV>
inline __m512bh pairs32(const KV* p) {
  return widen(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename KV>
inline __m512bh pairs32(const KV* p, __mmask32 mask) {
  return widen(p, _mm256_maskz_loadu_epi8(mask, p));
}
#endif

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

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// exp8 on sixteen lanes: the same operations in the same order, so each lane's value is exp8's.
inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(__mmask16(~under), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}
#endif
