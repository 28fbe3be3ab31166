// What sampling does to logits here: the structured-output mask, and greedy argmax.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

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

// Greedy decoding: each row's first maximum, a NaN counting as the maximum (torch.argmax's answer). One
// pass for the maximum and any NaN, eight lanes at a time, then one for its first index; rows in parallel.
at::Tensor argmax(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) > 0,
              "kiln_cpu::argmax: x must be 2-D float32 with at least one column");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = x.size(1), full = N / 8 * 8;
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * N;
      __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
      for (int64_t i = 0; i < full; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        top = _mm256_max_ps(top, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      float best = hmax(top);
      bool any_nan = _mm256_movemask_ps(nan) != 0;
      for (int64_t i = full; i < N; ++i) any_nan |= std::isnan(row[i]), best = std::max(best, row[i]);
      int64_t at = N;
      if (any_nan) {
        at = 0;
        while (!std::isnan(row[at])) ++at;
      } else {
        const __m256 b = _mm256_set1_ps(best);
        for (int64_t i = 0; i < full && at == N; i += 8) {
          const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), b, _CMP_EQ_OQ));
          if (hit) at = i + __builtin_ctz(hit);
        }
        for (int64_t i = full; i < N && at == N; ++i)
          if (row[i] == best) at = i;
      }
      op[m] = at;
    }
  });
  return out;
}
