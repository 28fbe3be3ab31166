// RoPE on q and k.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

// RoPE in the neox layout (halves): q [T, H, D] and k [T, KVH, D] float32, views of the fused qkv output
// (rows and heads any stride, d contiguous), rotated at positions [T] int64 by cos_sin [P, R] float32 (R/2
// cosines, then R/2 sines; R <= D, and the rest of each head passes through), into new contiguous tensors.
// Each element is x1 * cos - x2 * sin or x2 * cos + x1 * sin: two multiplies and an add, unfused, as torch's
// own ops compute them. Inductor's loop for this ran on one thread (it splits by the size a graph was
// traced at, and the graph that serves prefills is traced at a decode's); here tokens split across threads
// once there are enough of them, and a decode's few rows stay on one.
constexpr int64_t kRotaryGrain = 128;

inline void rotate_heads(const float* x, int64_t sh, int64_t heads, int64_t D, int64_t half, const float* cos,
                         const float* sin, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* xh = x + h * sh;
    float* oh = out + h * D;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 x1 = _mm256_loadu_ps(xh + i), x2 = _mm256_loadu_ps(xh + half + i);
      const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
      _mm256_storeu_ps(oh + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
      _mm256_storeu_ps(oh + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
    }
    for (; i < half; ++i) {
      const float x1 = xh[i], x2 = xh[half + i];
      oh[i] = x1 * cos[i] - x2 * sin[i];
      oh[half + i] = x2 * cos[i] + x1 * sin[i];
    }
    std::copy(xh + 2 * half, xh + D, oh + 2 * half);
  }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && q.dim() == 3 && k.dim() == 3 &&
                  q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.stride(2) == 1 && k.stride(2) == 1,
              "kiln_cpu::rotary: q and k must be [T, heads, D] float32 with d contiguous");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.is_contiguous() &&
                  cos_sin.size(1) % 2 == 0 && cos_sin.size(1) <= q.size(2),
              "kiln_cpu::rotary: cos_sin must be [positions, R] float32, R even and at most the head dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "kiln_cpu::rotary: positions must be int64 [T]");
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), P = cos_sin.size(0);
  const int64_t R = cos_sin.size(1), half = R / 2;
  at::Tensor q_out = at::empty({T, H, D}, q.options()), k_out = at::empty({T, KVH, D}, k.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *table = cos_sin.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, T, kRotaryGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(0 <= pos[t] && pos[t] < P, "kiln_cpu::rotary: position ", pos[t], " outside the table's ", P);
      const float* cos = table + pos[t] * R;
      rotate_heads(qp + t * q.stride(0), q.stride(1), H, D, half, cos, cos + half, qo + t * H * D);
      rotate_heads(kp + t * k.stride(0), k.stride(1), KVH, D, half, cos, cos + half, ko + t * KVH * D);
    }
  });
  return {q_out, k_out};
}
