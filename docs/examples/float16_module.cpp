// Float16Module: FP32 in, BF16 inside (except what the plan keeps), FP32 out.
#include <mixprec/mixprec.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <iostream>

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc = register_module("fc", torch::nn::Linear(32, 32));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
  }
  at::Tensor forward(const at::Tensor& x) {
    // fc runs in BF16; the FP32 norm gets an FP32 input.
    return norm(fc(x).to(at::kFloat));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Net);

int main() {
  mixprec::Float16Module model(Net(),
                               mixprec::Float16ModuleOptions()
                                   .dtype(at::kBFloat16)
                                   .plan(mixprec::PrecisionPlan().keep_fp32_pattern("norm.*")));
  std::cout << model->conversion_report().to_string();

  // The holder's operator() cannot deduce Float16Module's template forward: call forward().
  const at::Tensor y = model->forward(torch::randn({4, 32}));  // FP32 input cast to BF16
  std::cout << "output " << y.scalar_type() << "\n";           // cast back to FP32
  // Its state has no wrapper prefix: "fc.weight", not "module.fc.weight".
  return y.scalar_type() == at::kFloat && model->named_parameters().contains("fc.weight") ? 0 : 1;
}
