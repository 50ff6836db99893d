// Quantization configuration: which low-precision GEMM recipe a model uses.
#pragma once

#include <torch/arg.h>

#include <string>

namespace mixprec::quant {

// FP8 recipe. kE4M3: E4M3 for activations, weights and output gradients. kHybrid: E4M3 for
// forward's operands, E5M2 (wider range) for the output gradient backward's GEMMs read — as
// Transformer Engine's "hybrid" format (fake_quant.h: which tensors are rounded).
enum class Fp8Recipe { kOff, kE4M3, kHybrid };

// FP4 recipe. kNvFp4: E2M1 values, one E4M3 scale per 16 elements, one FP32 tensor scale.
enum class Fp4Recipe { kOff, kNvFp4 };

// The numeric format a quantization scope applies.
enum class QuantFormat { kNone, kFp8E4M3, kFp8Hybrid, kNvFp4 };

const char* to_string(Fp8Recipe recipe);
const char* to_string(Fp4Recipe recipe);
const char* to_string(QuantFormat format);

// Options in LibTorch's style: QuantConfig().fp8(Fp8Recipe::kHybrid).fp8_param(true).
// Any combination can be built; it is validated where it is used (the guards of
// quant_state.h call validate() before touching any state), so a bad one never takes effect.
struct QuantConfig {
  // FP8 recipe of forward GEMMs under autocast.
  TORCH_ARG(Fp8Recipe, fp8) = Fp8Recipe::kOff;
  // FP4 recipe of forward GEMMs under autocast (exclusive with fp8).
  TORCH_ARG(Fp4Recipe, fp4) = Fp4Recipe::kOff;
  // Create parameters as FP8 primary weights under model-init (needs fp8 on).
  TORCH_ARG(bool, fp8_param) = false;
  // Round parameters onto the NVFP4 grid when they are created under model-init (needs fp4
  // on). Unlike fp8_param they stay in their floating dtype and train normally, leaving the
  // grid at the first optimizer step (quant_linear.h).
  TORCH_ARG(bool, fp4_param) = false;

 public:
  // Throws c10::Error naming the conflicting fields: fp8 and fp4 both on (a GEMM has one
  // recipe), fp8_param without fp8, fp4_param without fp4.
  void validate() const;

  // Forward GEMMs quantize (the autocast scope applies): fp8 or fp4 on.
  bool quantizes_compute() const { return fp8_ != Fp8Recipe::kOff || fp4_ != Fp4Recipe::kOff; }
  // Parameters are created quantized (the model-init scope applies).
  bool quantizes_params() const { return fp8_param_ || fp4_param_; }
  // The format GEMMs use under this config (kNone if neither recipe is on).
  QuantFormat compute_format() const;

  std::string to_string() const;
};

}  // namespace mixprec::quant
