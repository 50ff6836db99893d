// Float16Optimizer: FP32 masters only for BF16/FP16 parameters; FP32 ones stepped in place.
#include <mixprec/mixprec.h>
#include <torch/nn/modules/linear.h>

#include <iostream>

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc = register_module("fc", torch::nn::Linear(32, 32));
    gate = register_parameter("gate", mixprec::keep_in_fp32(torch::ones({32})));
    mixprec::convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  at::Tensor loss(const at::Tensor& x) {
    return (fc(x.to(at::kBFloat16)).to(at::kFloat) * gate).pow(2).mean();
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor gate;
};
TORCH_MODULE(Net);

int main() {
  Net net;
  mixprec::optim::Float16Optimizer optimizer(
      *net, torch::optim::AdamWOptions(1e-3).weight_decay(0.1),
      mixprec::optim::Float16OptimizerOptions().clip_grad(1.0));
  for (const mixprec::optim::ParamInfo& p : optimizer.params_info()) {
    std::cout << p.fqn << ": " << mixprec::optim::to_string(p.role) << "\n";
  }
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    (net->loss(torch::randn({16, 32})) * optimizer.loss_scale()).backward();
    const mixprec::optim::StepResult r = optimizer.update();  // skipped if grads overflowed
    std::cout << "step " << step << ": grad norm " << r.grad_norm << "\n";
  }
  // Roles: fc.weight and fc.bias have masters (BF16 params), gate is stepped in place (FP32).
  int masters = 0;
  for (const mixprec::optim::ParamInfo& p : optimizer.params_info()) {
    masters += p.role == mixprec::optim::ParamRole::kMaster ? 1 : 0;
  }
  return masters == 2 && net->gate.scalar_type() == at::kFloat ? 0 : 1;
}
