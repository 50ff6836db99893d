#include "mixprec/quant/fake_quant.h"

#include "quant/kernels/fake_quant_fused.h"

#include <ATen/ATen.h>

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <limits>

namespace mixprec::quant {

namespace {

// Throws c10::Error naming `function` (the caller's public entry point) unless `dtype` is
// one of the two FP8 formats.
void check_fp8_dtype(c10::ScalarType dtype, const char* function) {
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "[mixprec::quant::", function,
              "] the target format must be Float8_e4m3fn or Float8_e5m2, got ", dtype);
}

// Throws c10::Error naming `function` unless `x` is a defined floating tensor of a
// high-precision dtype: an FP8 tensor is already quantized (and LibTorch counts FP8 dtypes
// as floating, so isFloatingType alone would let one through).
void check_high_precision_input(const at::Tensor& x, const char* function) {
  TORCH_CHECK(
      x.defined() && at::isFloatingType(x.scalar_type()) && !at::isFloat8Type(x.scalar_type()),
      "[mixprec::quant::", function,
      "] input must be a floating tensor of a high-precision dtype (FP32, BF16, FP16, "
      "FP64), got ",
      x.defined() ? c10::str(x.scalar_type(), " of shape ", x.sizes())
                  : std::string("an undefined tensor"));
}

// The dtype amax and scales are computed in: FP64 for an FP64 input, whose values may lie
// outside FP32's range (an FP32 amax of 1e39 is Inf, one of 1e-50 is 0), FP32 otherwise.
c10::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

double smallest_positive(c10::ScalarType compute) {
  return compute == at::kDouble ? std::numeric_limits<double>::denorm_min()
                                : std::numeric_limits<float>::denorm_min();
}

double largest_finite(c10::ScalarType compute) {
  return compute == at::kDouble ? std::numeric_limits<double>::max()
                                : std::numeric_limits<float>::max();
}

// `v` (FP32 or FP64, within the FP8 format's range) rounded to nearest-even in `fp8_dtype`.
// LibTorch converts FP64 to FP8 through FP32, rounding twice: a value just past a tie between
// two FP8 values can land on the tie in FP32 and then go the wrong way. Rounding to FP32 by
// round-to-odd instead (truncate, set the last bit if anything was lost) makes the second
// rounding exact, FP32 having more than two bits beyond any FP8 mantissa.
at::Tensor to_fp8(const at::Tensor& v, c10::ScalarType fp8_dtype) {
  if (v.scalar_type() != at::kDouble) return v.to(fp8_dtype);
  at::Tensor f = v.to(at::kFloat);
  const at::Tensor rounded_away = f.to(at::kDouble).abs() > v.abs();
  f = at::where(rounded_away, at::nextafter(f, at::zeros_like(f)), f);
  const at::Tensor inexact = (f.to(at::kDouble) != v).to(at::kInt);
  return at::bitwise_or(f.view(at::kInt), inexact).view(at::kFloat).to(fp8_dtype);
}

}  // namespace

double fp8_max(c10::ScalarType fp8_dtype) {
  check_fp8_dtype(fp8_dtype, "fp8_max");
  return fp8_dtype == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
}

ScaledFp8 quantize_fp8(const at::Tensor& x, c10::ScalarType fp8_dtype) {
  check_high_precision_input(x, "quantize_fp8");
  check_fp8_dtype(fp8_dtype, "quantize_fp8");
  const double max = fp8_max(fp8_dtype);
  at::NoGradGuard no_grad;
  const c10::ScalarType compute = compute_dtype(x);
  const at::Tensor xf = x.to(compute);
  const at::Tensor amax = xf.numel() ? xf.abs().amax() : at::zeros({}, xf.options());
  // amax == 0 (or empty) would divide by zero: any scale works, take 1. A scale below the
  // compute dtype's smallest denormal (an FP32 amax under ~6e-43) would round to 0 and make
  // 0 / 0: the smallest denormal instead. A NaN in x gives a NaN scale, so the whole result is
  // NaN — as an Inf already makes it — and the step it feeds is refused rather than trained on
  // values quantized against a meaningless scale.
  const at::Tensor scaled = at::clamp_min(amax / max, smallest_positive(compute));
  const at::Tensor scale_inv =
      at::where(amax > 0, scaled, at::where(at::isnan(amax), amax, at::ones_like(amax)));
  const at::Tensor data = to_fp8((xf / scale_inv).clamp(-max, max), fp8_dtype);
  return {data, scale_inv};
}

at::Tensor dequantize_fp8(const ScaledFp8& q, c10::ScalarType dtype) {
  at::NoGradGuard no_grad;
  // An FP64 scale (an FP64 input's) may lie outside FP32's range: the product is taken in FP64.
  const c10::ScalarType compute =
      q.scale_inv.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return (q.data.to(compute) * q.scale_inv).to(dtype);
}

at::Tensor fake_quantize_fp8(const at::Tensor& x, c10::ScalarType fp8_dtype) {
  check_high_precision_input(x, "fake_quantize_fp8");
  check_fp8_dtype(fp8_dtype, "fake_quantize_fp8");
  // The ATen composition below makes seven passes over the tensor and six temporaries; the
  // fused kernel computes the same values in two reads and one write.
  if (detail::fused_fake_quant_supports(x)) return detail::fused_fake_quantize_fp8(x, fp8_dtype);
  return dequantize_fp8(quantize_fp8(x, fp8_dtype), x.scalar_type());
}

namespace {

constexpr int64_t kNvFp4Block = 16;
constexpr double kE2M1Max = 6.0;
constexpr double kE4M3Max = 448.0;

// Round-to-nearest-even onto the E2M1 magnitudes: spacing 0.5 below 2, 1 below 4, 2 up to 6.
at::Tensor round_to_e2m1(const at::Tensor& v) {
  const at::Tensor a = v.abs().clamp_max(kE2M1Max);
  const at::Tensor step = at::where(a < 2, at::full_like(a, 0.5),
                                    at::where(a < 4, at::ones_like(a), at::full_like(a, 2.0)));
  return at::sign(v) * (at::round(a / step) * step).clamp_max(kE2M1Max);
}

}  // namespace

at::Tensor fake_quantize_nvfp4(const at::Tensor& x) {
  check_high_precision_input(x, "fake_quantize_nvfp4");
  at::NoGradGuard no_grad;
  if (x.numel() == 0) return x.clone();
  const int64_t last = x.dim() ? x.size(-1) : 1;
  const int64_t padded = (last + kNvFp4Block - 1) / kNvFp4Block * kNvFp4Block;
  const c10::ScalarType compute = compute_dtype(x);
  at::Tensor xf = x.to(compute).reshape({-1, last});
  if (padded != last) xf = at::constant_pad_nd(xf, {0, padded - last});
  at::Tensor blocks = xf.reshape({xf.size(0), padded / kNvFp4Block, kNvFp4Block});

  const at::Tensor tensor_amax = xf.abs().amax();
  // Global scale maps the largest block scale (amax / 6) onto E4M3's top of range. As in
  // Transformer Engine it is capped at the largest finite value: for an FP32 amax under
  // ~7.9e-36 the quotient overflows to Inf, and a block of zeros would decode as 0 * Inf.
  // A NaN in x makes the whole result NaN, as in quantize_fp8; so does an Inf (a global scale
  // of 0 makes every block scale 0 / 0).
  const at::Tensor global = at::where(
      tensor_amax > 0, (kE4M3Max * kE2M1Max / tensor_amax).clamp_max(largest_finite(compute)),
      at::where(at::isnan(tensor_amax), tensor_amax, at::ones_like(tensor_amax)));
  const at::Tensor block_amax = blocks.abs().amax(-1, /*keepdim=*/true);
  const at::Tensor block_scale_q =
      to_fp8((block_amax / kE2M1Max * global).clamp_max(kE4M3Max), at::kFloat8_e4m3fn).to(compute);
  const at::Tensor block_scale = block_scale_q / global;  // what a decoder reconstructs
  const at::Tensor safe = at::where(block_scale > 0, block_scale, at::ones_like(block_scale));
  const at::Tensor dq = round_to_e2m1(blocks / safe) * block_scale;
  return dq.reshape({xf.size(0), padded}).narrow(1, 0, last).reshape(x.sizes()).to(x.scalar_type());
}

namespace {

at::Tensor fake_quantize_for(const at::Tensor& x, QuantFormat format, bool gradient) {
  RECORD_USER_SCOPE("mixprec::fake_quant");  // a named range in --profile-steps traces
  switch (format) {
    case QuantFormat::kNone:
      return x;
    case QuantFormat::kFp8E4M3:
      return fake_quantize_fp8(x, at::kFloat8_e4m3fn);
    case QuantFormat::kFp8Hybrid:
      return fake_quantize_fp8(x, gradient ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
    case QuantFormat::kNvFp4:
      return fake_quantize_nvfp4(x);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown QuantFormat");
}

// Rounds its input in `format` — a GEMM operand in the forward format, or (kGradient) the
// gradient GEMMs' operand dY in the gradient format — and passes the gradient straight through.
// That backward is itself differentiable, so a graph built through a gradient's rounding
// (create_graph: a gradient penalty) stays differentiable.
template <bool kGradient>
struct RoundStraightThrough : torch::autograd::Function<RoundStraightThrough<kGradient>> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& x,
                            int64_t format) {
    return fake_quantize_for(x, static_cast<QuantFormat>(format), kGradient);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};
using GemmOperandQuant = RoundStraightThrough</*kGradient=*/false>;
using GradientRound = RoundStraightThrough</*kGradient=*/true>;

// The same node with forward's result computed by the caller (QuantLinear's kept weight).
struct KeptGemmOperandQuant : torch::autograd::Function<KeptGemmOperandQuant> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& /*x*/,
                            const at::Tensor& forward_value) {
    return forward_value;  // an input: autograd returns a view of it carrying this node
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// Identity forward; backward rounds the GEMM output's gradient dY (GradientRound), which both
// backward GEMMs then read. The format is recorded in the node, so backward (on any thread)
// does what forward decided whatever scopes are active then.
struct GemmOutputGradientQuant : torch::autograd::Function<GemmOutputGradientQuant> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            int64_t format) {
    ctx->saved_data["format"] = format;
    // Not y itself (autograd would make the output a view of it, which must not be written in
    // place): a tensor of its own on y's storage, as at::linear's result is to its caller.
    return y.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {GradientRound::apply(grads[0], ctx->saved_data["format"].toInt()), at::Tensor()};
  }
};

}  // namespace

at::Tensor quantize_for_gemm(const at::Tensor& x, QuantFormat format) {
  if (format == QuantFormat::kNone) return x;
  return GemmOperandQuant::apply(x, static_cast<int64_t>(format));
}

at::Tensor fake_quantize_operand(const at::Tensor& x, QuantFormat format) {
  at::NoGradGuard no_grad;
  return fake_quantize_for(x, format, /*gradient=*/false);
}

at::Tensor quantize_for_gemm(const at::Tensor& x, QuantFormat format,
                             const at::Tensor& forward_value) {
  TORCH_CHECK(forward_value.defined() && forward_value.sizes() == x.sizes() &&
                  forward_value.scalar_type() == x.scalar_type(),
              "[mixprec::quant::quantize_for_gemm] forward_value must have x's shape ", x.sizes(),
              " and dtype ", x.scalar_type(), ", got ",
              forward_value.defined()
                  ? c10::str(forward_value.sizes(), " ", forward_value.scalar_type())
                  : std::string("undefined"));
  if (format == QuantFormat::kNone) return x;
  return KeptGemmOperandQuant::apply(x, forward_value.detach());
}

at::Tensor quantize_gemm_output_gradient(const at::Tensor& y, QuantFormat format) {
  if (format == QuantFormat::kNone) return y;
  return GemmOutputGradientQuant::apply(y, static_cast<int64_t>(format));
}

}  // namespace mixprec::quant
