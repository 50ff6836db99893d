// A mixture-of-experts MLP: a router sends each token to its top-k experts.
//
//   x ──► router (FP32) ──► softmax ──► probs [tokens, E]
//                 choose top-k experts by probs + expert_bias     (the bias only steers choice)
//                 gates = the chosen probs, renormalized to sum 1
//   y = Σ_k gate_k · expert_k(x),   expert(x) = W2 · gelu(W1 · x)   (BF16 GEMMs, FP8 operands)
//
// Two mechanisms keep the experts evenly loaded:
//   * the load-balancing auxiliary loss (Switch Transformer): E · Σ_e f_e · P_e, where f_e is the
//     fraction of routing slots that went to expert e and P_e its mean router probability; it is
//     smallest when both are uniform;
//   * aux-loss-free balancing (DeepSeek-V3): after each optimizer step, every expert's bias
//     moves by ±rate towards the mean load — overloaded experts become less attractive. The
//     bias is a buffer (state, not a parameter: no gradient), it must stay FP32 (steps of 1e-3
//     vanish in BF16 next to values near 1) and move with the model, so it is registered and
//     lands in every checkpoint.
//
// Precision: the router's weight is marked keep_in_fp32 right where it is created (a mark
// travels with the tensor); expert_bias is kept FP32 by name in the precision plan (plan.cpp).
// Routing runs with FP8 disabled: rounding the router's inputs to FP8 would change which
// experts tokens go to.
#pragma once

#include "mixprec/quant/quant_config.h"
#include "mixprec/quant/quant_linear.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

namespace train {

// One expert: a two-layer MLP, 4x wide, whose GEMMs honour the FP8 autocast scope.
struct ExpertImpl : torch::nn::Module {
  ExpertImpl(int64_t d_model, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);  // [n, d_model] → [n, d_model]

  mixprec::quant::QuantLinear fc{nullptr};    // d_model → hidden
  mixprec::quant::QuantLinear proj{nullptr};  // hidden → d_model
};
TORCH_MODULE(Expert);

struct MoEOutput {
  at::Tensor y;         // [n, d_model], x's dtype
  at::Tensor aux_loss;  // FP32 scalar, the load-balancing loss (differentiable)
};

struct MoEImpl : torch::nn::Module {
  MoEImpl(int64_t d_model, int64_t experts, int64_t top_k, mixprec::quant::QuantConfig quant);

  // x: [n, d_model] in the model's half dtype. In training mode the tokens each expert
  // received are added to the load counter that update_expert_bias consumes.
  MoEOutput forward(const at::Tensor& x);

  // Aux-loss-free balancing: bias_e += rate · sign(mean load − load_e) over the tokens counted
  // since the last call, then the counter restarts. Call once per optimizer step.
  void update_expert_bias(double rate);

  // Tokens routed to each expert since the last update_expert_bias (int64 [experts]).
  const at::Tensor& load() const { return load_; }

  int64_t top_k;
  mixprec::quant::QuantConfig quant;
  mixprec::quant::QuantLinear router{nullptr};  // d_model → experts, no bias, FP32 by mark
  torch::nn::ModuleList experts{nullptr};
  at::Tensor expert_bias;  // FP32 buffer [experts]
  // Whether forward in training mode adds to the load counter; off while --recompute runs a
  // block's forward a second time (recompute.cpp), so that no token is counted twice.
  bool counts_load = true;

 private:
  at::Tensor load_;  // not a buffer: zero at every step boundary, so checkpoints need not hold it
};
TORCH_MODULE(MoE);

}  // namespace train
