#include "plan.h"

#include "mixprec/quant/quant_state.h"

#include <algorithm>

namespace train {

Precision precision_from(const TrainConfig& config) {
  Precision p;
  p.dtype = config.precision == "fp16" ? at::kHalf : at::kBFloat16;
  // FP16 has 5 exponent bits: small gradients underflow unless the loss is scaled up first;
  // BF16 has FP32's range and needs no scaling.
  if (p.dtype == at::kHalf) {
    p.scaler = mixprec::optim::LossScalerOptions::fp16_dynamic();
    p.scaler.initial_scale(config.loss_scale);
    p.scaler.max_scale(std::max(p.scaler.max_scale(), config.loss_scale));
  }
  using mixprec::quant::Fp8Recipe;
  p.quant.fp8(config.fp8 == "e4m3"     ? Fp8Recipe::kE4M3
              : config.fp8 == "hybrid" ? Fp8Recipe::kHybrid
                                       : Fp8Recipe::kOff);
  p.quant.validate();
  return p;
}

GptConfig gpt_config(const TrainConfig& c, const mixprec::quant::QuantConfig& quant) {
  return {c.vocab, c.seq_len, c.layers, c.d_model, c.heads, c.experts, c.top_k, quant, c.recompute};
}

mixprec::PrecisionPlan precision_plan(const GptImpl& model) {
  mixprec::PrecisionPlan plan;
  for (const std::string& name : model.expert_bias_names()) plan.keep_fp32_name(name);
  plan.keep_fp32_pattern("*norm*");
  return plan;
}

std::tuple<at::Tensor, at::Tensor> MixedModel::forward(const at::Tensor& tokens) {
  mixprec::quant::QuantAutocastGuard fp8(quant);  // a no-op scope when --fp8 off
  return module->forward<std::tuple<at::Tensor, at::Tensor>>(tokens);
}

MixedModel apply_precision(Gpt gpt, const Precision& precision) {
  // The logits stay in the model's dtype: the loss reads them in FP32 itself
  // (mixprec::cross_entropy_in_fp32), without an FP32 copy of the whole batch's.
  mixprec::Float16Module module(gpt, mixprec::Float16ModuleOptions()
                                         .dtype(precision.dtype)
                                         .plan(precision_plan(*gpt))
                                         .fp32_output(false));
  return {std::move(gpt), std::move(module), precision.quant};
}

}  // namespace train
