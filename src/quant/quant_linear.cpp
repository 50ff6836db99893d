#include "mixprec/quant/quant_linear.h"

#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"
#include "mixprec/quant/fake_quant.h"
#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <cmath>

namespace mixprec::quant {

namespace {
std::string short_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "fp32";
    case at::kBFloat16:
      return "bf16";
    case at::kHalf:
      return "fp16";
    case at::kDouble:
      return "fp64";
    default:
      return c10::toString(t);
  }
}

// Identity on y (whose forward already added the bias); backward gives y its gradient and the
// bias the sum of it over every dimension but the last, as a linear layer's bias gets.
struct BiasGradient : torch::autograd::Function<BiasGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& y,
                            const at::Tensor& /*bias*/) {
    return y.detach();  // not y itself: the output may be written in place (fake_quant.cpp)
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad = grads[0];
    return {grad, grad.reshape({-1, grad.size(-1)}).sum(0)};
  }
};

// Whether a model-init scope builds FP8 primary weights.
bool is_fp8_init(const QuantScopeState& init) {
  return init.enabled &&
         (init.format == QuantFormat::kFp8E4M3 || init.format == QuantFormat::kFp8Hybrid);
}

// What a format's forward rounding is: both FP8 recipes round operands to E4M3 in forward
// (they differ in backward only), so one kept weight operand serves both.
QuantFormat forward_operand_format(QuantFormat format) {
  return format == QuantFormat::kFp8Hybrid ? QuantFormat::kFp8E4M3 : format;
}

}  // namespace

std::string LinearCompute::to_string() const {
  std::string out =
      operands == QuantFormat::kNone
          ? short_name(dtype)
          : std::string(quant::to_string(operands)) + " operands, " + short_name(dtype) + " GEMM";
  if (fp8_weight) out += ", fp8 primary weight";
  if (kept_fp32) out += ", weight kept fp32";
  if (input_kept_fp32) out += ", input kept fp32";
  return out;
}

QuantLinearImpl::QuantLinearImpl(QuantLinearOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "[mixprec::QuantLinear] in_features and out_features must be positive, got ",
              options.in_features(), " and ", options.out_features());
  reset();
}

void QuantLinearImpl::reset() {
  // Same initialization as torch::nn::Linear.
  at::Tensor w = at::empty({options.out_features(), options.in_features()});
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  // A rebuild (the weight exists already) keeps the module's layout, FP8 primary weight or
  // not, whatever scope is active: Cloneable::clone() rebuilds its copy with reset() before
  // copying the data in, and refuses a copy whose parameters or buffers differ from the
  // original's — a clone taken inside an FP8 init scope (an EMA copy built with the model)
  // would otherwise gain a weight_scale_inv. Only the first build reads the scope.
  const bool rebuild = weight.defined();
  const QuantScopeState init = rebuild ? QuantScopeState{} : model_init_state();
  const bool fp8 = rebuild ? weight_scale_inv.defined() : is_fp8_init(init);
  weight_scale_inv = at::Tensor();
  if (fp8) {
    ScaledFp8 q = quantize_fp8(w, at::kFloat8_e4m3fn);
    weight = register_parameter("weight", q.data, /*requires_grad=*/false);
    // The scale is part of the FP8 weight: a conversion to BF16 must not round it (every
    // dequantized value would move with it).
    weight_scale_inv = register_buffer("weight_scale_inv", keep_in_fp32(q.scale_inv));
  } else {
    if (init.enabled && init.format == QuantFormat::kNvFp4) w = fake_quantize_nvfp4(w);
    weight = register_parameter("weight", w);
  }
  if (options.bias()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
    bias = register_parameter("bias", at::empty({options.out_features()}).uniform_(-bound, bound));
  } else {
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
}

at::Tensor QuantLinearImpl::dequantized_weight(c10::ScalarType dtype) const {
  if (has_fp8_weight()) return dequantize_fp8({weight, weight_scale_inv}, dtype);
  return weight.to(dtype);
}

at::Tensor QuantLinearImpl::forward(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(),
              "[mixprec::QuantLinear] a QuantLinear(", options.in_features(), ", ",
              options.out_features(), ") expects input (..., ", options.in_features(),
              "), got shape ", input.sizes());
  // LibTorch counts FP8 dtypes as floating; an FP8 input would make the GEMM run in FP8.
  TORCH_CHECK(at::isFloatingType(input.scalar_type()) && !at::isFloat8Type(input.scalar_type()),
              "[mixprec::QuantLinear] a QuantLinear(", options.in_features(), ", ",
              options.out_features(),
              ") takes a high-precision floating input (FP32, BF16, FP16, FP64), got ",
              input.scalar_type(), " of shape ", input.sizes());
  LinearCompute record;
  record.fp8_weight = has_fp8_weight();
  // Kept FP32 by any of the plan's three mechanisms (a mark, a name, a pattern).
  record.kept_fp32 = is_kept_fp32_by_mark_or_plan(weight);
  record.input_kept_fp32 = is_kept_in_fp32(input);
  // An FP32-kept operand (weight or input) pulls the GEMM up to FP32 and out of quantization;
  // FP8 weights run in the input's dtype.
  const bool fp32_gemm = record.kept_fp32 || record.input_kept_fp32;
  record.dtype = fp32_gemm           ? at::kFloat
                 : record.fp8_weight ? input.scalar_type()
                                     : weight.scalar_type();
  const QuantScopeState scope = autocast_state();
  if (scope.enabled && scope.format != QuantFormat::kNone && !fp32_gemm) {
    record.operands = scope.format;
  }
  at::Tensor x = input.to(record.dtype);
  if (record.operands != QuantFormat::kNone) x = quantize_for_gemm(x, record.operands);
  at::Tensor w;
  // The weight operand changes only when the weight does (an optimizer step, a load): it comes
  // from weight_cache_, which recomputes it after any write to the weight (operand_cache.h).
  if (record.fp8_weight) {
    // An FP8 primary weight is on the FP8 grid already: quantizing it again in an FP8 format
    // changes nothing; NVFP4 still rounds it. Never differentiable (dequantized without grad).
    const QuantFormat format =
        record.operands == QuantFormat::kNvFp4 ? QuantFormat::kNvFp4 : QuantFormat::kNone;
    w = weight_cache_.get({weight, weight_scale_inv}, {format, record.dtype}, [&] {
      const at::Tensor dequantized = dequantized_weight(record.dtype);
      return format == QuantFormat::kNone ? dequantized
                                          : fake_quantize_operand(dequantized, format);
    });
  } else {
    w = weight.to(record.dtype);
    if (record.operands != QuantFormat::kNone) {
      const QuantFormat format = forward_operand_format(record.operands);
      const at::Tensor forward = weight_cache_.get(
          {weight}, {format, record.dtype}, [&] { return fake_quantize_operand(w, format); });
      w = quantize_for_gemm(w, record.operands, forward);
    }
  }
  last_compute_.set(record);
  const at::Tensor b = bias.defined() ? bias.to(record.dtype) : bias;
  if (record.operands == QuantFormat::kNone) return at::linear(x, w, b);
  if (!b.defined()) return quantize_gemm_output_gradient(at::linear(x, w), record.operands);
  // The bias is added inside the GEMM, as without quantization (one rounding of the output);
  // its gradient is taken after the output-gradient node, from the unrounded dY.
  const at::Tensor y = quantize_gemm_output_gradient(at::linear(x, w, b.detach()), record.operands);
  return BiasGradient::apply(y, b);
}

}  // namespace mixprec::quant
