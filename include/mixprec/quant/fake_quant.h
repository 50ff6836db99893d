// Quantization kernels for the CPU path: real FP8 dtypes, per-tensor scaling.
//
// FP8 uses LibTorch's Float8_e4m3fn / Float8_e5m2 dtypes, so rounding (nearest-even) and the
// representable values are exactly the hardware's; "fake" quantization means the GEMM that
// follows runs in the high-precision dtype on the dequantized values. Scaling is per tensor
// from the current amax (Transformer Engine's "current scaling"): scale = fp8_max / amax,
// values saturate at ±fp8_max. Scales stay tensors (no host sync).
#pragma once

#include "mixprec/quant/quant_config.h"

#include <ATen/core/Tensor.h>

namespace mixprec::quant {

// An FP8 tensor and the factor that maps it back: x ≈ data.to(float) * scale_inv.
struct ScaledFp8 {
  at::Tensor data;  // dtype Float8_e4m3fn or Float8_e5m2, the input's shape
  // A 0-dim FP32 tensor (FP64 for an FP64 input), amax / fp8_max (1 if amax is 0).
  at::Tensor scale_inv;
};

// Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2).
double fp8_max(c10::ScalarType fp8_dtype);

// Quantizes a floating tensor (any float dtype) with per-tensor amax scaling (scale_inv =
// amax / fp8_max, at least the smallest denormal; 1 for an all-zero tensor). Amax and scale are
// computed in FP32, or in FP64 for an FP64 input, whose values may lie outside FP32's range;
// either way each scaled value goes straight to the nearest FP8 value (an FP64 one
// not through FP32, which would round twice). A NaN or Inf anywhere in x
// makes every value of the dequantized result NaN: non-finite input is loud.
// Throws c10::Error if `x` is not a floating tensor of a high-precision dtype (an FP8 tensor
// is refused) or `fp8_dtype` is not e4m3fn/e5m2.
ScaledFp8 quantize_fp8(const at::Tensor& x, c10::ScalarType fp8_dtype);

// data * scale_inv, in `dtype` (computed in FP32, or FP64 for an FP64 scale_inv).
at::Tensor dequantize_fp8(const ScaledFp8& q, c10::ScalarType dtype);

// quantize_fp8 then dequantize_fp8 back to x's dtype, without materializing the FP8 tensor.
// Not differentiable; the result is a new tensor. On CPU for FP32/BF16/FP16 a fused,
// vectorized, multithreaded kernel computes it: every non-NaN value is bit for bit what
// dequantize_fp8(quantize_fp8(x, fp8_dtype), x.scalar_type()) gives, NaNs are at the same
// places (their payload bits may differ: ATen's own vectorized and scalar code disagree).
// Throws c10::Error like quantize_fp8.
at::Tensor fake_quantize_fp8(const at::Tensor& x, c10::ScalarType fp8_dtype);

// NVFP4 fake quantization along the last dimension: blocks of 16 values share an E4M3 scale
// (itself scaled by an FP32 per-tensor scale so block scales fit E4M3 — FP64 for an FP64
// input; as in Transformer Engine at most the largest finite value, so a tiny tensor's zeros
// stay zeros); values are rounded to nearest-even on the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4,
// 6}. A NaN or Inf anywhere in x makes every value NaN. Returns x's dtype and shape.
// Throws c10::Error like quantize_fp8 for an input that is not high-precision floating.
at::Tensor fake_quantize_nvfp4(const at::Tensor& x);

// A fake-quantized GEMM in autograd, as Transformer Engine's FP8 recipes define it: forward
// Y = Xq · Wqᵀ on operands rounded to the recipe's forward format; backward dX = dYq · Wq and
// dW = dYqᵀ · Xq, where dYq is the output gradient rounded to the recipe's gradient format and
// the results dX, dW stay in the GEMM's dtype. Three pieces build it around any GEMM:
//   quantize_for_gemm(X), quantize_for_gemm(W)  — the operands (forward rounding; backward
//                                                  passes the gradient straight through);
//   quantize_gemm_output_gradient(Y)            — the output (identity in forward; backward
//                                                  rounds dY).
// Formats: forward E4M3 for both FP8 recipes and NVFP4 for kNvFp4; gradient E4M3 for
// kFp8E4M3, E5M2 for kFp8Hybrid, NVFP4 for kNvFp4. QuantLinear takes its bias's gradient after
// quantize_gemm_output_gradient, from the unrounded dY. The FP8 recipes (per-tensor scales)
// are Transformer Engine's; NVFP4 is not NVIDIA's training recipe: dY is rounded once, in
// blocks of 16 along its last dimension, for both GEMMs, where that recipe rounds the weight
// gradient's operands in blocks along the tokens, with a random Hadamard transform and
// stochastic rounding. Each piece records the format in its autograd node: backward (on any
// thread) does what forward decided, whatever scopes are active then. Every backward is itself
// differentiable (straight-through), so a graph built with create_graph (a gradient penalty)
// can be differentiated again. kNone returns the input itself.
at::Tensor quantize_for_gemm(const at::Tensor& x, QuantFormat format);

// What quantize_for_gemm(x, format) computes in forward, as a plain tensor outside autograd.
at::Tensor fake_quantize_operand(const at::Tensor& x, QuantFormat format);

// quantize_for_gemm(x, format) with its forward result supplied: `forward_value` must equal
// fake_quantize_operand(x, format) (e.g. kept from an earlier call while x is unchanged, as
// QuantLinear does for its weight). Returns a view of forward_value whose gradient flows to x
// straight through, as quantize_for_gemm's does. Throws c10::Error if the shapes or dtypes of
// x and forward_value differ.
at::Tensor quantize_for_gemm(const at::Tensor& x, QuantFormat format,
                             const at::Tensor& forward_value);

// The output side of a quantized GEMM (see above): returns `y`'s values (on its storage, not a
// view: it may be written in place, as a GEMM's result may) with a backward that rounds the
// incoming gradient in `format`'s gradient format.
at::Tensor quantize_gemm_output_gradient(const at::Tensor& y, QuantFormat format);

}  // namespace mixprec::quant
