// kiln's CPU kernels: a linear layer over packed 16- or 32-bit weights and paged attention, both
// batch-invariant, RoPE and the structured-output token mask. Every output element is computed by the same
// sequence of operations whatever the number of rows in the call, how rows are tiled, or how work is split
// across threads:
//  - linear: y[m, n] = bias[n] + sum over k of x[m, k] * w[n, k], accumulated in float32 by one chain in
//    k order (an FMA per k, or with bfloat16 pairs on AVX512-BF16, a dot product per pair of k); gate_up
//    (AMX) takes two such sums per element, g and u, and gives silu(g) * u;
//  - attention: a query row's online softmax walks its context in KV-cache blocks from position 0.
// Built once per machine by kiln/ops/cpu/native.py; registered as torch ops under `kiln_cpu`.
// The kernels are in the parts included below, one concept each, compiled as this one translation unit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <type_traits>
#include <utility>
#include <cmath>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kiln's CPU kernels need AVX2, FMA and F16C"
#endif

namespace {

#include "vec.h"
#include "linear.h"
#include "attention.h"
#include "kv_cache.h"
#include "rotary.h"
#include "logits.h"
#include "threads.h"

}  // namespace

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("linear(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("gate_up(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("bf16_dot() -> bool", &bf16_dot);  // whether linear takes pair-packed bfloat16 weights here
  m.def("amx() -> bool", &amx);              // whether it multiplies them with AMX tiles
  m.def("bind_threads(int[] cpus) -> ()", &bind_threads);
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale, int sliding_window, bool pairs) -> Tensor");
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos_sin) -> (Tensor, Tensor)");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, bool pairs) -> ()");
  m.def("apply_bitmask(Tensor(a!) logits, Tensor bitmask, int[] rows) -> ()");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("gate_up", &gate_up);
  m.impl("paged_attention", &paged_attention);
  m.impl("rotary", &rotary);
  m.impl("write_kv", &write_kv);
  m.impl("apply_bitmask", &apply_bitmask);
  m.impl("argmax", &argmax);
}
