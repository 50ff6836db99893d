#include "gpt.h"

#include "attention.h"
#include "recompute.h"

#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/linear.h>
#include <torch/types.h>

#include <cmath>

namespace train {
namespace {

torch::nn::LayerNorm layer_norm(int64_t d) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}));
}

}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t heads) : heads(heads) {
  qkv = register_module(
      "qkv", torch::nn::Linear(torch::nn::LinearOptions(d_model, 3 * d_model).bias(false)));
  proj = register_module("proj",
                         torch::nn::Linear(torch::nn::LinearOptions(d_model, d_model).bias(false)));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  // [B, T, 3C] → three [B, heads, T, head_dim] tensors. unbind, not three selects: its
  // backward writes the three gradients into one tensor, where each select's would zero-fill a
  // tensor of all three and add them up (1.2 ms of a 90 ms step in a profile).
  const std::vector<at::Tensor> qkv_heads =
      qkv(x).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
  const at::Tensor &q = qkv_heads[0], &k = qkv_heads[1], &v = qkv_heads[2];
  // y = softmax(q kᵀ / √head_dim + causal mask) v: scores[i, j] say how much position i
  // attends to position j, the mask (−∞ for j > i) keeps every position from seeing its future,
  // each row of weights sums to 1 and mixes the values. One fused kernel does it all without
  // materializing the [T, T] scores. Computed in FP32 like the norms: on CPU LibTorch's FP32
  // kernel is as fast as written-out BF16 math at T = 128 and 2x faster at T = 256, its BF16
  // kernel ~3x slower (bench/train_bench.cpp), and the softmax is more accurate in FP32. What
  // backward keeps is the BF16 q, k, v, not their FP32 copies (attention.h).
  const at::Tensor y = causal_attention_in_fp32(q, k, v).to(x.scalar_type());
  return proj(y.transpose(1, 2).reshape({B, T, C}));
}

BlockImpl::BlockImpl(const GptConfig& c) {
  attn_norm = register_module("attn_norm", layer_norm(c.d_model));
  attn = register_module("attn", CausalSelfAttention(c.d_model, c.heads));
  mlp_norm = register_module("mlp_norm", layer_norm(c.d_model));
  moe = register_module("moe", MoE(c.d_model, c.experts, c.top_k, c.quant));
}

std::tuple<at::Tensor, at::Tensor> BlockImpl::forward(const at::Tensor& x) {
  // The norms have FP32 weights and get the BF16/FP16 stream as it is: LibTorch's layer_norm
  // computes the statistics in FP32 and returns the input's dtype (no FP32 copy of the stream).
  at::Tensor h = x + attn(attn_norm(x));
  // The MoE routes tokens, not sequences: flatten [B, T, d] to [B·T, d] and back.
  const MoEOutput mlp = moe(mlp_norm(h).flatten(0, 1));
  return {h + mlp.y.view_as(h), mlp.aux_loss};
}

GptImpl::GptImpl(const GptConfig& c) : config(c) {
  tok_emb = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.d_model));
  pos_emb = register_module("pos_emb", torch::nn::Embedding(c.seq_len, c.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
  final_norm = register_module("final_norm", layer_norm(c.d_model));

  // GPT-2 initialization. Norms start as the identity (LayerNorm's own weight 1, bias 0).
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    if (name.find("norm") != std::string::npos) continue;
    const bool into_residual = name.ends_with("attn.proj.weight") || name.ends_with(".proj.weight");
    item.value().normal_(0.0, into_residual ? residual_std : 0.02);
  }
}

std::tuple<at::Tensor, at::Tensor> GptImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= config.seq_len,
              "[mixprec-train::Gpt] tokens must be [batch, T] with T <= ", config.seq_len, ", got ",
              tokens.sizes());
  const at::Tensor positions = at::arange(tokens.size(1), tokens.options());
  if (before_use) {
    before_use(*tok_emb);
    before_use(*pos_emb);
  }
  at::Tensor x = tok_emb(tokens) + pos_emb(positions);
  at::Tensor aux = at::zeros({}, at::kFloat);
  for (const auto& block : *blocks) {
    if (before_use) before_use(*block);
    BlockImpl& b = *block->as<BlockImpl>();
    auto [next, block_aux] =
        config.recompute && is_training() ? forward_recomputed_in_backward(b, x) : b.forward(x);
    x = next;
    aux = aux + block_aux;
  }
  if (before_use) before_use(*final_norm);
  x = final_norm(x);
  at::Tensor logits;
  {
    // The head scores all 256 bytes; FP8 here would blur the scores the loss depends on.
    auto no_fp8 = mixprec::quant::fp8_disabled_context(config.quant, /*is_init=*/false);
    logits = torch::nn::functional::linear(x, tok_emb->weight);  // tied: the embedding itself
  }
  return {logits, aux / static_cast<double>(config.layers)};
}

void GptImpl::update_expert_biases(double rate) {
  for (const auto& block : *blocks) block->as<BlockImpl>()->moe->update_expert_bias(rate);
}

std::vector<at::Tensor> GptImpl::expert_loads() const {
  std::vector<at::Tensor> loads;
  for (const auto& block : *blocks) loads.push_back(block->as<BlockImpl>()->moe->load());
  return loads;
}

std::vector<std::string> GptImpl::expert_bias_names() const {
  std::vector<std::string> names;
  for (const auto& item : named_buffers()) {
    if (item.key().ends_with("moe.expert_bias")) names.push_back(item.key());
  }
  return names;
}

}  // namespace train
