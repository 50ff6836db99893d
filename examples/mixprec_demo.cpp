// mixprec-demo: the selective-FP32 precision plan and quantization scopes on a toy MoE block.
//
// Builds a small model with an MoE-style router, norms and buffers; keeps what must stay FP32
// (router weight by a mark on the tensor, expert_bias by name, norms by pattern); converts the
// rest to BF16 through Float16Module; runs a forward pass under an FP8 autocast scope with FP8
// disabled around the router and the head; prints the conversion report and what each linear
// actually computed in.
#include "mixprec/precision/float16_module.h"
#include "mixprec/precision/keep_fp32.h"
#include "mixprec/quant/quant_linear.h"
#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>

#include <cstdio>

namespace {

using mixprec::quant::QuantConfig;
using mixprec::quant::QuantLinear;

struct ToyMoEImpl : torch::nn::Module {
  ToyMoEImpl(int64_t width, int64_t experts, int64_t vocab, QuantConfig quant)
      : quant(quant) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    router = register_module("router", QuantLinear(mixprec::quant::QuantLinearOptions(width, experts).bias(false)));
    mixprec::keep_in_fp32(router->weight);  // on the tensor, at the call site
    expert_list = register_module("experts", torch::nn::ModuleList());
    for (int64_t e = 0; e < experts; ++e) expert_list->push_back(QuantLinear(width, width));
    head = register_module("head", QuantLinear(width, vocab));
    expert_bias = register_buffer("expert_bias", torch::zeros({experts}));
    tokens_per_expert = register_buffer("tokens_per_expert", torch::zeros({experts}, torch::kLong));
  }

  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = norm(x);
    at::Tensor gate;
    {
      // The router decides where tokens go: FP8 rounding here changes routing, so it runs
      // with quantization off (and in FP32, as its weight is kept FP32).
      auto no_fp8 = mixprec::quant::fp8_disabled_context(quant, /*is_init=*/false);
      gate = at::softmax(router(h) + expert_bias, -1);
    }
    const at::Tensor choice = gate.argmax(-1);
    at::Tensor out = at::zeros_like(h);
    for (size_t e = 0; e < expert_list->size(); ++e) {
      const at::Tensor mask = (choice == static_cast<int64_t>(e)).to(h.scalar_type()).unsqueeze(-1);
      const at::Tensor weight = gate.select(-1, e).unsqueeze(-1).to(h.scalar_type());
      out = out + mask * weight * expert_list[e]->as<mixprec::quant::QuantLinearImpl>()->forward(h);
    }
    tokens_per_expert += at::bincount(choice, {}, expert_list->size());
    auto no_fp8 = mixprec::quant::fp8_disabled_context(quant, /*is_init=*/false);
    return head(out);
  }

  QuantConfig quant;
  torch::nn::LayerNorm norm{nullptr};
  QuantLinear router{nullptr};
  torch::nn::ModuleList expert_list{nullptr};
  QuantLinear head{nullptr};
  at::Tensor expert_bias, tokens_per_expert;
};
TORCH_MODULE(ToyMoE);

}  // namespace

int main() {
  at::manual_seed(0);
  const QuantConfig quant = QuantConfig().fp8(mixprec::quant::Fp8Recipe::kHybrid);
  ToyMoE model(64, 4, 32, quant);

  auto plan = mixprec::PrecisionPlan().keep_fp32_name("expert_bias").keep_fp32_pattern("*norm*");
  std::printf("precision plan: router.weight marked on the tensor; name 'expert_bias'; "
              "pattern '*norm*'\n");
  std::printf("quantization: %s\n\n", quant.to_string().c_str());

  mixprec::Float16Module wrapped(model, mixprec::Float16ModuleOptions().dtype(at::kBFloat16).plan(plan));
  std::printf("conversion report\n%s\n", wrapped->conversion_report().to_string().c_str());

  const at::Tensor tokens = torch::randn({16, 64});
  at::Tensor logits;
  {
    mixprec::quant::QuantAutocastGuard fp8(quant);
    logits = wrapped->forward(tokens);
  }
  std::printf("forward: input %s -> logits %s %s\n", c10::toString(tokens.scalar_type()),
              c10::toString(logits.scalar_type()), c10::str(logits.sizes()).c_str());
  std::printf("tokens per expert (int64 buffer, still %s):",
              c10::toString(model->tokens_per_expert.scalar_type()));
  for (int64_t e = 0; e < model->tokens_per_expert.numel(); ++e) {
    std::printf(" %lld", static_cast<long long>(model->tokens_per_expert[e].item<int64_t>()));
  }
  std::printf("\n\n");

  std::printf("what each linear computed in\n");
  for (const auto& item : wrapped->named_modules("", /*include_self=*/false)) {
    if (auto* linear = item.value()->as<mixprec::quant::QuantLinearImpl>()) {
      std::printf("  %-10s %s\n", (item.key() + ":").c_str(),
                  linear->last_compute().to_string().c_str());
    }
  }
  return 0;
}
