#include "moe.h"

#include "mixprec/precision/keep_fp32.h"
#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <torch/types.h>

#include <algorithm>
#include <bit>
#include <vector>

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

// Where each routing slot's row lies in the experts' padded input buffer, expert after expert.
struct ExpertRows {
  std::vector<int64_t> padded;  // rows per expert, padded (0 for an expert without tokens)
  at::Tensor source;   // [Σ padded] the token each row holds; `tokens` (a zero row) for padding
  at::Tensor of_slot;  // [tokens · top_k] the row that holds each routing slot
};

ExpertRows dispatch_rows(const at::Tensor& flat_choice, const at::Tensor& counts, int64_t top_k,
                         int64_t tokens) {
  const at::Tensor choice = flat_choice.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor count = counts.to(at::kCPU, at::kLong).contiguous();
  const int64_t n_experts = count.numel();
  ExpertRows out;
  std::vector<int64_t> next(n_experts);  // each expert's next free row
  int64_t total = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    next[e] = total;
    out.padded.push_back(bucketed_rows(count.data_ptr<int64_t>()[e]));
    total += out.padded.back();
  }
  at::Tensor source = at::full({total}, tokens, at::kLong);
  at::Tensor of_slot = at::empty({choice.numel()}, at::kLong);
  int64_t* source_row = source.data_ptr<int64_t>();
  int64_t* slot_row = of_slot.data_ptr<int64_t>();
  const int64_t* expert = choice.data_ptr<int64_t>();
  for (int64_t slot = 0; slot < choice.numel(); ++slot) {
    const int64_t row = next[expert[slot]]++;
    source_row[row] = slot / top_k;
    slot_row[slot] = row;
  }
  out.source = source.to(flat_choice.device());
  out.of_slot = of_slot.to(flat_choice.device());
  return out;
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

  // Dispatch: each expert runs once on the tokens that chose it, as one run of rows in a single
  // padded buffer (one gather in, one gather out); the routing slots keep their order within an
  // expert. Each token's result is the gate-weighted sum of its top-k expert outputs. Against a
  // gather, pad and index_add per expert (whose backward zero-fills a whole [tokens, d_model]
  // gradient per expert), the same bits 3-9% faster a step (six interleaved 150-step rounds).
  const at::Tensor flat_choice = chosen.reshape(-1);
  const at::Tensor counts = at::bincount(flat_choice, {}, n_experts);
  const ExpertRows rows = dispatch_rows(flat_choice, counts, top_k, x.size(0));
  const std::vector<at::Tensor> inputs = at::constant_pad_nd(x, {0, 0, 0, 1})
                                             .index_select(0, rows.source)
                                             .split_with_sizes(rows.padded);
  std::vector<at::Tensor> outputs;
  for (int64_t e = 0; e < n_experts; ++e) {
    // An expert without tokens is not run: it gets no gradient, so the optimizer skips it.
    if (rows.padded[e] != 0) outputs.push_back(experts[e]->as<ExpertImpl>()->forward(inputs[e]));
  }
  const at::Tensor picked =
      at::cat(outputs).index_select(0, rows.of_slot).view({x.size(0), top_k, -1});
  const at::Tensor y = (picked * gates.unsqueeze(-1).to(picked.scalar_type())).sum(1);

  // Load-balancing loss: E · Σ_e (share of routing slots of e) · (mean probability of e).
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
