// The precision plan of the run: which dtype the model trains in, what stays FP32 and why,
// and the FP8 recipe of the expert GEMMs.
//
// mixprec offers three ways to keep a tensor FP32; this program uses each once:
//   * a mark on the tensor, at creation: the MoE router weight (moe.cpp, keep_in_fp32);
//   * a fully qualified name in the plan: each MoE layer's expert_bias buffer;
//   * a name pattern in the plan: "*norm*", every LayerNorm weight and bias.
#pragma once

#include "config.h"
#include "gpt.h"

#include "mixprec/optim/loss_scaler.h"
#include "mixprec/precision/float16_module.h"
#include "mixprec/precision/precision_plan.h"
#include "mixprec/quant/quant_config.h"

#include <c10/core/ScalarType.h>

namespace train {

struct Precision {
  c10::ScalarType dtype = at::kBFloat16;     // the half dtype of everything not kept FP32
  mixprec::quant::QuantConfig quant;         // FP8 recipe for the expert GEMMs
  mixprec::optim::LossScalerOptions scaler;  // constant 1 for BF16, dynamic for FP16
};

// From --precision and --fp8 (already validated).
Precision precision_from(const TrainConfig& config);

// The model's shape from the flags, with the expert GEMMs' FP8 recipe.
GptConfig gpt_config(const TrainConfig& config, const mixprec::quant::QuantConfig& quant);

// The plan for `model`: expert biases by name, norms by pattern (the router is marked on the
// tensor and needs no entry here).
mixprec::PrecisionPlan precision_plan(const GptImpl& model);

// The GPT with its precision applied: Float16Module converts it once (in place, keeping every
// tensor's identity) and then casts at its boundary — FP32 inputs to the half dtype (tokens
// are int64 and pass through), half outputs back to FP32 for the loss.
struct MixedModel {
  Gpt gpt;
  mixprec::Float16Module module;
  mixprec::quant::QuantConfig quant;

  // logits [B, T, vocab] and the load-balancing loss, both FP32, computed under the FP8
  // autocast scope of `quant` (the model itself turns it off around router and head).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& tokens);
};

// Converts `gpt` with precision_plan(gpt) to precision.dtype. Throws c10::Error before changing
// anything if the plan does not resolve against the model.
MixedModel apply_precision(Gpt gpt, const Precision& precision);

}  // namespace train
