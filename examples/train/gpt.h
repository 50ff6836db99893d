// The model: a decoder-only GPT whose MLPs are mixtures of experts.
//
//   tokens [B, T] (bytes)
//     │  x = tok_emb[tokens] + pos_emb[0..T)                       [B, T, d]
//     ▼
//   N blocks, each "pre-norm": normalize, transform, add back to the residual stream x
//     x = x + attn(attn_norm(x))       causal self-attention: a token sees only its past
//     x = x + moe(mlp_norm(x))         each token goes through its top-k experts (moe.h)
//     ▼
//   final_norm, then the head: logits = x · tok_embᵀ                [B, T, vocab]
//
// The head is tied to the token embedding: the same matrix turns a byte into a vector on the
// way in and scores every byte against a vector on the way out. It is used twice in forward,
// never registered twice, so the model has one tensor (and the optimizer one parameter) for it.
//
// Precision (set up in plan.cpp, applied by Float16Module): everything BF16 (or FP16) except
// the router weights (marked FP32 in moe.cpp), the expert biases (kept by name) and every
// norm's weight and bias (kept by the pattern "*norm*"). Norms and the attention softmax compute
// in FP32 and hand the residual stream its own dtype back. The expert GEMMs run under
// the caller's FP8 autocast scope (QuantAutocastGuard); router and head turn it off.
#pragma once

#include "moe.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <functional>
#include <tuple>

namespace train {

struct GptConfig {
  int64_t vocab = 256;
  int64_t seq_len = 128;  // the longest context (positions)
  int64_t layers = 2;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t experts = 4;
  int64_t top_k = 2;
  mixprec::quant::QuantConfig quant;  // the FP8 recipe of the expert GEMMs
  // Keep only each block's input for backward and run the block again there (recompute.h).
  bool recompute = false;
};

// Multi-head causal self-attention: every position mixes the values of the positions up to it,
// weighted by softmax(q · k / √head_dim).
struct CausalSelfAttentionImpl : torch::nn::Module {
  CausalSelfAttentionImpl(int64_t d_model, int64_t heads);
  at::Tensor forward(const at::Tensor& x);  // [B, T, d] → [B, T, d]

  int64_t heads;
  torch::nn::Linear qkv{nullptr};   // d → 3d: queries, keys and values of all heads at once
  torch::nn::Linear proj{nullptr};  // d → d: mixes the heads' outputs
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  BlockImpl(const GptConfig& config);
  // Returns the new residual stream and this block's load-balancing loss.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x);

  torch::nn::LayerNorm attn_norm{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm mlp_norm{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  // Builds the model in FP32 with GPT-2's initialization (normal(0, 0.02); the projections
  // into the residual stream scaled by 1/√(2·layers)) from the default CPU generator.
  explicit GptImpl(const GptConfig& config);

  // tokens: int64 [B, T] with T ≤ seq_len. Returns {logits [B, T, vocab] in the model's dtype,
  // the mean over blocks of the MoE load-balancing loss (FP32 scalar)}.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& tokens);

  // Aux-loss-free balancing for every MoE layer (see MoEImpl::update_expert_bias).
  void update_expert_biases(double rate);
  // Every MoE layer's token counter since the last update (MoEImpl::load), aliased: data
  // parallelism sums them over ranks in place before the update.
  std::vector<at::Tensor> expert_loads() const;

  // Fully qualified names of the expert-bias buffers ("blocks.0.moe.expert_bias", …): the
  // precision plan keeps them FP32 by name.
  std::vector<std::string> expert_bias_names() const;

  // Called with each part of the model (embeddings, each block, the final norm) just before
  // forward reads it, when set: data parallelism with an overlapped parameter gather waits
  // there for that part's parameters (GradReducer::wait_for_params).
  std::function<void(const torch::nn::Module&)> before_use;

  GptConfig config;
  torch::nn::Embedding tok_emb{nullptr};
  torch::nn::Embedding pos_emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm final_norm{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace train
