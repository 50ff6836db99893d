// Private interface between the ATen-facing fused fake quantization (fake_quant_fused.cpp,
// which validates tensors, picks the scale and splits the work over threads) and the
// per-target SIMD kernels (fake_quant_simd.cpp, compiled once per Highway target and chosen at
// run time, like src/optim/kernels).
//
// Free of ATen types: the SIMD translation unit includes only Highway.
#pragma once

#include <cstdint>

namespace mixprec::quant::detail {

// Element format of the tensor being fake-quantized (input and output alike).
enum class ElementFormat : int { kF32, kBF16, kF16 };
// The FP8 grid values are rounded onto.
enum class Fp8Format : int { kE4M3, kE5M2 };

// The largest |x[i]| over [begin, end), as the bit pattern of x's format with the sign bit
// cleared. Magnitudes order like their bit patterns, and every NaN's pattern lies above the
// infinity's: the result is a NaN pattern exactly when some element is NaN (at::amax's
// NaN propagation).
uint32_t amax_bits_chunk(const void* x, ElementFormat format, int64_t begin, int64_t end);

// y[i] = to_format(fp8_decode(fp8_round(clamp(float(x[i]) / scale_inv, ±fp8_max))) * scale_inv)
// for i in [begin, end): the ATen composition of fake_quant.cpp, element for element
// (IEEE division and product, NaN propagating through the clamp, c10's Float8 rounding).
// x and y may be the same buffer; chunks of one call must not overlap.
// nan_free: the caller guarantees that no element is or becomes NaN — true when the amax of
// the whole tensor is finite and scale_inv > 0 (|x| <= amax, so x / scale_inv stays within
// ~fp8_max and no 0/0, Inf/Inf or 0*Inf arises); the kernel then skips its NaN handling.
void fake_quant_chunk(const void* x, void* y, ElementFormat format, Fp8Format fp8, float scale_inv,
                      bool nan_free, int64_t begin, int64_t end);

}  // namespace mixprec::quant::detail
