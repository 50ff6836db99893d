#include "quant/kernels/fake_quant_fused.h"

#include "optim/kernels/parallel_chunks.h"
#include "quant/kernels/fake_quant_args.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

namespace mixprec::quant::detail {
namespace {

ElementFormat element_format(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return ElementFormat::kBF16;
    case at::kHalf:
      return ElementFormat::kF16;
    case at::kFloat:
      return ElementFormat::kF32;
    default:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "fused fake quantization called for ", dtype);
}

// The amax's value from its bit pattern (sign cleared) in x's format. FP16 goes through c10's
// conversion, exact for every pattern.
float amax_value(uint32_t bits, ElementFormat format) {
  switch (format) {
    case ElementFormat::kBF16:
      return std::bit_cast<float>(bits << 16);
    case ElementFormat::kF16:
      return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
    case ElementFormat::kF32:
      break;
  }
  return std::bit_cast<float>(bits);
}

}  // namespace

bool fused_fake_quant_supports(const at::Tensor& x) {
  if (!x.defined() || !x.device().is_cpu() || x.layout() != at::kStrided) return false;
  // The kernel reads raw memory: a ZeroTensor has none (its data pointer is null), and a
  // conjugate view's bit would be ignored (a neg view's is resolved before the kernel).
  if (x._is_zerotensor() || x.is_conj()) return false;
  const auto dtype = x.scalar_type();
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

at::Tensor fused_fake_quantize_fp8(const at::Tensor& x, c10::ScalarType fp8_dtype) {
  TORCH_INTERNAL_ASSERT(fused_fake_quant_supports(x));
  TORCH_INTERNAL_ASSERT(fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2);
  at::NoGradGuard no_grad;
  // A negative view (at::_neg_view) keeps its neg bit through contiguous(): the raw values
  // would be read with the wrong sign.
  const at::Tensor in = x.is_neg() ? x.resolve_neg().contiguous() : x.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().requires_grad(false));
  const int64_t n = in.numel();
  if (n == 0) return out;
  const ElementFormat format = element_format(in.scalar_type());
  const void* src = in.const_data_ptr();
  void* dst = out.mutable_data_ptr();

  // Pass 1: amax. Each chunk's maximum lands in its own slot, so the result does not depend
  // on which thread ran which chunk.
  const int64_t grain = optim::detail::kGrainSize;
  std::vector<uint32_t> chunk_max((n + grain - 1) / grain, 0);
  optim::detail::for_each_chunk(n, [&](int64_t begin, int64_t end) {
    chunk_max[begin / grain] = amax_bits_chunk(src, format, begin, end);
  });
  const float amax = amax_value(*std::max_element(chunk_max.begin(), chunk_max.end()), format);
  // quantize_fp8's scale: amax / fp8_max in FP32, at least the smallest denormal; 1 for a
  // zero amax, NaN for a NaN one.
  const float fp8_max = fp8_dtype == at::kFloat8_e4m3fn ? 448.0f : 57344.0f;
  const float scale_inv = amax > 0
                              ? std::max(amax / fp8_max, std::numeric_limits<float>::denorm_min())
                          : std::isnan(amax) ? amax
                                             : 1.0f;
  // Neither NaN inputs nor 0/0, Inf/Inf, 0*Inf can occur: the kernel may skip NaN handling.
  const bool nan_free = std::isfinite(amax) && scale_inv > 0;
  const Fp8Format fp8 = fp8_dtype == at::kFloat8_e4m3fn ? Fp8Format::kE4M3 : Fp8Format::kE5M2;

  // Pass 2: quantize and dequantize, one read and one write.
  optim::detail::for_each_chunk(n, [&](int64_t begin, int64_t end) {
    fake_quant_chunk(src, dst, format, fp8, scale_inv, nan_free, begin, end);
  });
  return out;
}

}  // namespace mixprec::quant::detail
