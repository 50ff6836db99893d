#include "mixprec/quant/quant_config.h"

#include <c10/util/Exception.h>

namespace mixprec::quant {

const char* to_string(Fp8Recipe recipe) {
  switch (recipe) {
    case Fp8Recipe::kOff:
      return "off";
    case Fp8Recipe::kE4M3:
      return "e4m3";
    case Fp8Recipe::kHybrid:
      return "hybrid";
  }
  return "?";
}

const char* to_string(Fp4Recipe recipe) { return recipe == Fp4Recipe::kNvFp4 ? "nvfp4" : "off"; }

const char* to_string(QuantFormat format) {
  switch (format) {
    case QuantFormat::kNone:
      return "none";
    case QuantFormat::kFp8E4M3:
      return "fp8-e4m3";
    case QuantFormat::kFp8Hybrid:
      return "fp8-hybrid";
    case QuantFormat::kNvFp4:
      return "nvfp4";
  }
  return "?";
}

void QuantConfig::validate() const {
  TORCH_CHECK(!(fp8_ != Fp8Recipe::kOff && fp4_ != Fp4Recipe::kOff),
              "[mixprec::QuantConfig] fp8=", quant::to_string(fp8_),
              " and fp4=", quant::to_string(fp4_),
              " are both on; a GEMM uses one recipe, turn one off");
  TORCH_CHECK(!fp8_param_ || fp8_ != Fp8Recipe::kOff,
              "[mixprec::QuantConfig] fp8_param=true needs fp8 on (fp8=off)");
  TORCH_CHECK(!fp4_param_ || fp4_ != Fp4Recipe::kOff,
              "[mixprec::QuantConfig] fp4_param=true needs fp4 on (fp4=off)");
}

QuantFormat QuantConfig::compute_format() const {
  if (fp8_ == Fp8Recipe::kE4M3) return QuantFormat::kFp8E4M3;
  if (fp8_ == Fp8Recipe::kHybrid) return QuantFormat::kFp8Hybrid;
  if (fp4_ == Fp4Recipe::kNvFp4) return QuantFormat::kNvFp4;
  return QuantFormat::kNone;
}

std::string QuantConfig::to_string() const {
  return std::string("fp8=") + quant::to_string(fp8_) + " fp4=" + quant::to_string(fp4_) +
         " fp8_param=" + (fp8_param_ ? "true" : "false") +
         " fp4_param=" + (fp4_param_ ? "true" : "false");
}

}  // namespace mixprec::quant
