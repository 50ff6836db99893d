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
//     scope's format before the GEMM, and backward rounds the output gradient dY that both
//     backward GEMMs read (fake_quant.h: a quantized GEMM as Transformer Engine's recipes
//     define it; a bias gets the unrounded dY).
//   * A weight kept FP32 — marked keep_in_fp32, or kept by a conversion's plan name or
//     pattern (kept_fp32_reason) — is never quantized: forward computes in FP32. So does an
//     input marked keep_in_fp32.
//   * The weight's GEMM operand (fake-quantized, or dequantized for FP8 weights) is kept
//     between forwards and recomputed only after the weight changes: an in-place write (an
//     optimizer step, copy_, a checkpoint load), set_data or a new tensor (OperandCache,
//     operand_cache.h, lists what it sees). After writing the weight's memory behind
//     LibTorch's back (Tensor::data(), raw pointers), or through another tensor sharing its
//     storage (after w.set_data(t), writes through t; an EMA swapped in that way), call
//     clear_operand_cache().
// Otherwise it is a plain y = x Wᵀ + b in the weight's dtype (the input's for FP8 weights).
//
// Threads: forward may run on several threads at once (as torch::nn::Linear's can); they
// share the kept operand, which one of them computes while the others wait.
#pragma once

#include "mixprec/quant/operand_cache.h"
#include "mixprec/quant/quant_config.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <mutex>
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
  // The dtype of the GEMM's operands and result (LibTorch's CPU GEMMs accumulate BF16 and
  // FP16 products in FP32).
  c10::ScalarType dtype = at::kFloat;
  bool fp8_weight = false;       // the weight is an FP8 primary weight
  bool kept_fp32 = false;        // the weight is kept FP32 (a mark, a plan name or pattern)
  bool input_kept_fp32 = false;  // the input is marked keep_in_fp32
  std::string to_string() const;
};

class QuantLinearImpl : public torch::nn::Cloneable<QuantLinearImpl> {
 public:
  QuantLinearImpl(int64_t in_features, int64_t out_features)
      : QuantLinearImpl(QuantLinearOptions(in_features, out_features)) {}
  // Throws c10::Error if a feature count is not positive.
  explicit QuantLinearImpl(QuantLinearOptions options);

  // Creates weight and bias; the first call (construction) reads the model-init scope (see
  // above). A rebuild — clone() calls reset() on its copy — keeps the module's layout (an FP8
  // primary weight or not) whatever scope is active, so clone() and clone_module work for
  // either kind, inside an init scope or not.
  void reset() override;

  // input: (..., in_features), a high-precision floating dtype. Returns (..., out_features) in
  // the compute dtype. Throws c10::Error naming the layer by its features ("a QuantLinear(128,
  // 512)": a LibTorch module does not know its path in the model) and the input's shape and
  // dtype if the last dimension is wrong or the input is not high-precision floating (an FP8
  // input is refused).
  at::Tensor forward(const at::Tensor& input);

  // The weight as a floating tensor (dequantized if FP8), in `dtype`.
  at::Tensor dequantized_weight(c10::ScalarType dtype) const;
  bool has_fp8_weight() const { return weight_scale_inv.defined(); }
  // What the most recent forward computed in (default-constructed before the first).
  LinearCompute last_compute() const { return last_compute_.get(); }
  // Forgets the kept weight operand; the next forward recomputes it.
  void clear_operand_cache() { weight_cache_.clear(); }
  // How many times forward has computed the weight operand (tests, benchmarks).
  int64_t operand_computations() const { return weight_cache_.computations(); }

  QuantLinearOptions options;
  at::Tensor weight;
  at::Tensor bias;
  at::Tensor weight_scale_inv;  // defined only for FP8 primary weights

 private:
  // The most recent forward's record; forwards on several threads write it under a lock.
  class LastCompute {
   public:
    LastCompute() = default;
    LastCompute(const LastCompute& other) : value_(other.get()) {}
    LastCompute& operator=(const LastCompute& other) {
      set(other.get());
      return *this;
    }
    LinearCompute get() const {
      std::lock_guard<std::mutex> lock(mutex_);
      return value_;
    }
    void set(const LinearCompute& value) {
      std::lock_guard<std::mutex> lock(mutex_);
      value_ = value;
    }

   private:
    mutable std::mutex mutex_;
    LinearCompute value_;
  };

  LastCompute last_compute_;
  OperandCache weight_cache_;  // copies start empty: clone() recomputes
};

TORCH_MODULE(QuantLinear);

}  // namespace mixprec::quant
