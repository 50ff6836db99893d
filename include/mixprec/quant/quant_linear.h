// QuantLinear: a linear layer that honours the quantization scopes (quant_state.h).
//
//   * Built inside an enabled model-init scope with an FP8 format, its weight is an FP8
//     primary weight: parameter "weight" has dtype Float8_e4m3fn and buffer
//     "weight_scale_inv" holds its per-tensor scale (marked keep_in_fp32: a conversion never
//     rounds it). It is not trained: requires_grad is false, it gets no gradient, and
//     Float16Optimizer treats it as frozen — for frozen or inference layers; to train in FP8,
//     keep the weight BF16 and run forward inside an autocast scope. With kNvFp4 the initial weight
//     is rounded onto the NVFP4 grid but stored unpacked in its floating dtype.
//   * Run inside an enabled autocast scope, forward fake-quantizes input and weight in the
//     scope's format before the GEMM (quantize_for_gemm: gradients follow the recipe).
//   * A weight kept FP32 — marked keep_in_fp32, or kept by a conversion's plan name or
//     pattern (kept_fp32_reason) — is never quantized: forward computes in FP32.
//   * The weight's GEMM operand (fake-quantized, or dequantized for FP8 weights) is kept
//     between forwards and recomputed only after the weight changes: an in-place write (an
//     optimizer step, copy_, a checkpoint load), set_data or a new tensor (OperandCache,
//     operand_cache.h, lists what it sees). After writing the weight's memory behind
//     LibTorch's back (Tensor::data(), raw pointers), or through another tensor sharing its
//     storage (after w.set_data(t), writes through t; an EMA swapped in that way), call
//     clear_operand_cache().
// Otherwise it is a plain y = x Wᵀ + b in the weight's dtype (the input's for FP8 weights).
#pragma once

#include "mixprec/quant/operand_cache.h"
#include "mixprec/quant/quant_config.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace mixprec::quant {

struct QuantLinearOptions {
  QuantLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
};

// What one forward call computed in.
struct LinearCompute {
  QuantFormat operands = QuantFormat::kNone;  // GEMM operand quantization applied
  c10::ScalarType dtype = at::kFloat;         // dtype the GEMM ran (and accumulated) in
  bool fp8_weight = false;                    // the weight is an FP8 primary weight
  bool kept_fp32 = false;                     // the weight is marked keep_in_fp32
  std::string to_string() const;
};

class QuantLinearImpl : public torch::nn::Cloneable<QuantLinearImpl> {
 public:
  QuantLinearImpl(int64_t in_features, int64_t out_features)
      : QuantLinearImpl(QuantLinearOptions(in_features, out_features)) {}
  // Throws c10::Error if a feature count is not positive.
  explicit QuantLinearImpl(QuantLinearOptions options);

  // Reads the model-init scope (see above) and (re)creates weight and bias. A module that
  // already has an FP8 weight keeps the FP8 layout, so clone() works for FP8 modules too.
  void reset() override;

  // input: (..., in_features), any floating dtype. Returns (..., out_features) in the
  // compute dtype. Throws c10::Error naming the module if the last dimension is wrong.
  at::Tensor forward(const at::Tensor& input);

  // The weight as a floating tensor (dequantized if FP8), in `dtype`.
  at::Tensor dequantized_weight(c10::ScalarType dtype) const;
  bool has_fp8_weight() const { return weight_scale_inv.defined(); }
  // What the most recent forward computed in (default-constructed before the first).
  const LinearCompute& last_compute() const { return last_compute_; }
  // Forgets the kept weight operand; the next forward recomputes it.
  void clear_operand_cache() { weight_cache_.clear(); }
  // How many times forward has computed the weight operand (tests, benchmarks).
  int64_t operand_computations() const { return weight_cache_.computations(); }

  QuantLinearOptions options;
  at::Tensor weight;
  at::Tensor bias;
  at::Tensor weight_scale_inv;  // defined only for FP8 primary weights

 private:
  LinearCompute last_compute_;
  OperandCache weight_cache_;  // copies start empty: clone() recomputes
};

TORCH_MODULE(QuantLinear);

}  // namespace mixprec::quant
