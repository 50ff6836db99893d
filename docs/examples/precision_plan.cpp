// Keep a few tensors FP32 (a mark on the tensor, a name, a pattern) and convert the rest.
#include <mixprec/mixprec.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <iostream>

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
    proj = register_module("proj", torch::nn::Linear(64, 64));
    // On the tensor: the mark survives to(), load, mixprec::clone_module and the conversion.
    router = register_parameter("router", mixprec::keep_in_fp32(torch::randn({8, 64})));
    expert_bias = register_buffer("expert_bias", torch::zeros({8}));
    tokens = register_buffer("tokens", torch::zeros({8}, torch::kLong));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear proj{nullptr};
  at::Tensor router, expert_bias, tokens;
};
TORCH_MODULE(Block);

int main() {
  Block block;
  const auto plan = mixprec::PrecisionPlan()
                        .keep_fp32_name("expert_bias")  // a fully qualified name
                        .keep_fp32_pattern("*norm*");   // a glob over names
  const mixprec::ConversionReport report =
      mixprec::convert_module_to_dtype_except_fp32_marked(*block, at::kBFloat16, plan);
  std::cout << report.to_string();  // per tensor: dtype before -> after, and why

  // proj is BF16; router, expert_bias and norm stay FP32; the int64 buffer is left alone.
  const bool ok = block->proj->weight.scalar_type() == at::kBFloat16 &&
                  block->router.scalar_type() == at::kFloat &&
                  block->norm->weight.scalar_type() == at::kFloat &&
                  block->tokens.scalar_type() == at::kLong &&
                  mixprec::kept_fp32_reason(block->expert_bias).rule == "expert_bias";
  return ok ? 0 : 1;
}
