#include "moe.h"

#include "mixprec/precision/keep_fp32.h"
#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <torch/types.h>

#include <algorithm>
#include <bit>

namespace train {
namespace {

// Expert batches are padded with zero rows to a bucketed size: 64 rows, or an eighth of the
// next lower power of two, whichever is more (≤ 12.5% padding). Token counts per expert change
// every step, and oneDNN (LibTorch's BF16 GEMM on CPU) compiles and caches kernels for every
// new shape: unbucketed, a run compiles thousands and holds a gigabyte of them; with buckets it
// sees a few dozen shapes. Zero rows change nothing: the experts have no biases (f(0) = 0), and
// the rows cut off afterwards send no gradient back.
int64_t bucketed_rows(int64_t rows) {
  const int64_t bucket = std::max<int64_t>(64, std::bit_floor(static_cast<uint64_t>(rows)) / 8);
  return (rows + bucket - 1) / bucket * bucket;
}

}  // namespace

using mixprec::quant::QuantLinear;
using mixprec::quant::QuantLinearOptions;

ExpertImpl::ExpertImpl(int64_t d_model, int64_t hidden) {
  fc = register_module("fc", QuantLinear(QuantLinearOptions(d_model, hidden).bias(false)));
  proj = register_module("proj", QuantLinear(QuantLinearOptions(hidden, d_model).bias(false)));
}

at::Tensor ExpertImpl::forward(const at::Tensor& x) { return proj(at::gelu(fc(x))); }

MoEImpl::MoEImpl(int64_t d_model, int64_t n_experts, int64_t top_k,
                 mixprec::quant::QuantConfig quant)
    : top_k(top_k), quant(quant) {
  router =
      register_module("router", QuantLinear(QuantLinearOptions(d_model, n_experts).bias(false)));
  mixprec::keep_in_fp32(router->weight);  // mechanism 1 of 3: a mark on the tensor itself
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < n_experts; ++e) experts->push_back(Expert(d_model, 4 * d_model));
  expert_bias = register_buffer("expert_bias", torch::zeros({n_experts}));
  load_ = torch::zeros({n_experts}, torch::kLong);
}

MoEOutput MoEImpl::forward(const at::Tensor& x) {
  const int64_t n_experts = static_cast<int64_t>(experts->size());
  at::Tensor probs;
  {
    auto no_fp8 = mixprec::quant::fp8_disabled_context(quant, /*is_init=*/false);
    probs = at::softmax(router(x.to(at::kFloat)), -1);  // FP32 weight, FP32 math
  }
  at::Tensor chosen;  // [n, top_k] expert ids; the bias steers the choice but not the gates
  {
    at::NoGradGuard no_grad;
    chosen = std::get<1>(at::topk(probs + expert_bias, top_k, -1));
  }
  at::Tensor gates = probs.gather(-1, chosen);
  gates = gates / gates.sum(-1, /*keepdim=*/true);

  // Dispatch: each expert runs once on the tokens that chose it; results are scattered back,
  // weighted by their gates. index_add_ is deterministic on CPU, so runs are reproducible.
  at::Tensor y = at::zeros_like(x);
  const at::Tensor flat_choice = chosen.reshape(-1);
  for (int64_t e = 0; e < n_experts; ++e) {
    const at::Tensor slots = (flat_choice == e).nonzero().squeeze(1);  // into [n * top_k]
    if (slots.numel() == 0) continue;
    const at::Tensor tokens = at::div(slots, top_k, "floor");
    const at::Tensor gate = gates.reshape(-1).index_select(0, slots).unsqueeze(1);
    const int64_t rows = tokens.numel();
    const int64_t padding = bucketed_rows(rows) - rows;
    const at::Tensor input = at::constant_pad_nd(x.index_select(0, tokens), {0, 0, 0, padding});
    const at::Tensor out = experts[e]->as<ExpertImpl>()->forward(input).narrow(0, 0, rows);
    y.index_add_(0, tokens, out * gate.to(out.scalar_type()));
  }

  // Load-balancing loss: E · Σ_e (share of routing slots of e) · (mean probability of e).
  const at::Tensor counts = at::bincount(flat_choice, {}, n_experts);
  const at::Tensor slot_share = counts.to(at::kFloat) / static_cast<double>(flat_choice.numel());
  const at::Tensor aux = (slot_share * probs.mean(0)).sum() * static_cast<double>(n_experts);
  if (is_training() && counts_load) load_ += counts;
  return {y, aux};
}

void MoEImpl::update_expert_bias(double rate) {
  at::NoGradGuard no_grad;
  const at::Tensor load = load_.to(at::kFloat);
  expert_bias.add_(at::sign(load.mean() - load) * rate);
  load_.zero_();
}

}  // namespace train
