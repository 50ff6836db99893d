// The fused CPU path of fake_quantize_fp8 (fake_quant.h): per-tensor amax in one read, then
// quantize → dequantize in one read and one write, vectorized (fake_quant_simd.cpp) and split
// over LibTorch's threads.
//
// Its results equal the ATen composition's (dequantize_fp8(quantize_fp8(x, f), x's dtype)) bit
// for bit for every non-NaN output, and it writes NaN exactly where that does; a NaN's bits are
// those ATen's vectorized conversions write (FP32: the decoded FP8 NaN with its sign; BF16:
// 0xFFFF; FP16: sign, 0x7C00 and the FP32 NaN's top mantissa bits), which ATen's own scalar
// tails do not always reproduce, so tests compare NaNs by position.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::quant::detail {

// Whether fused_fake_quantize_fp8 takes x: a defined CPU tensor of dtype Float, BFloat16 or
// Half (any shape and strides; non-contiguous input is made contiguous first, a negative view
// resolved), not a ZeroTensor (it has no memory to read; the ATen composition gives its zeros).
bool fused_fake_quant_supports(const at::Tensor& x);

// fake_quantize_fp8(x, fp8_dtype) for a tensor fused_fake_quant_supports; fp8_dtype is
// Float8_e4m3fn or Float8_e5m2 (the caller has checked both). Returns a new contiguous tensor
// of x's dtype and shape that does not require grad.
at::Tensor fused_fake_quantize_fp8(const at::Tensor& x, c10::ScalarType fp8_dtype);

}  // namespace mixprec::quant::detail
