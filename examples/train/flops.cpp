#include "flops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

namespace train {

double active_matmul_params(const TrainConfig& c) {
  const double d = static_cast<double>(c.d_model);
  const double hidden = 4 * d;                 // each expert's width (moe.cpp)
  const double attention = 3 * d * d + d * d;  // qkv and the output projection
  const double router = d * static_cast<double>(c.experts);
  const double experts = static_cast<double>(c.top_k) * 2 * d * hidden;  // fc and proj
  const double lm_head = d * 256;  // tied to the byte embedding (vocab 256)
  return static_cast<double>(c.layers) * (attention + router + experts) + lm_head;
}

double training_flops_per_token(const TrainConfig& c) {
  const double attention_scores = 12.0 * static_cast<double>(c.layers) *
                                  static_cast<double>(c.d_model) * static_cast<double>(c.seq_len);
  return 6.0 * active_matmul_params(c) + attention_scores;
}

double measure_bf16_gemm_flops() {
  constexpr int64_t n = 1024;
  const at::Tensor a = at::randn({n, n}).to(at::kBFloat16);
  const at::Tensor b = at::randn({n, n}).to(at::kBFloat16);
  at::Tensor c = at::empty({n, n}, a.options());
  at::mm_out(c, a, b);  // warm-up: packing buffers, the thread pool
  double best = 1e30;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    at::mm_out(c, a, b);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(n * n * n) / best;
}

}  // namespace train
