// Quantization scopes: FP8 GEMMs under autocast, switched off around a router.
#include <mixprec/mixprec.h>

#include <iostream>

namespace mq = mixprec::quant;

int main() {
  const auto config = mq::QuantConfig().fp8(mq::Fp8Recipe::kHybrid);
  mq::QuantLinear expert(64, 64), router(64, 8);
  const at::Tensor x = torch::randn({4, 64});
  {
    mq::QuantAutocastGuard autocast(config);  // this thread's forward GEMMs quantize to FP8
    const at::Tensor h = expert(x);
    {
      // A routing decision must not see FP8 rounding. A no-op guard if the config has no FP8.
      auto no_fp8 = mq::fp8_disabled_context(config, /*is_init=*/false);
      router(h);
    }
    std::cout << "expert: " << expert->last_compute().to_string() << "\n"
              << "router: " << router->last_compute().to_string() << "\n";
  }  // every scope is restored here, on exceptions too

  // Under the model-init scope, QuantLinear stores its weight as an FP8 primary weight.
  mq::QuantModelInitGuard init(mq::QuantConfig().fp8(mq::Fp8Recipe::kE4M3).fp8_param(true));
  mq::QuantLinear stored(64, 64);
  std::cout << "stored weight: " << stored->weight.scalar_type() << "\n";
  return expert->last_compute().operands == mq::QuantFormat::kFp8Hybrid &&
                 router->last_compute().operands == mq::QuantFormat::kNone &&
                 stored->has_fp8_weight()
             ? 0
             : 1;
}
