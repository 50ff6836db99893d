// The loss in FP32 from BF16 logits, without an FP32 copy of them.
#include <mixprec/mixprec.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <iostream>

int main() {
  // A head that scores 256 classes; the wrapper keeps its BF16 output as it is.
  mixprec::Float16Module head(
      torch::nn::Linear(64, 256),
      mixprec::Float16ModuleOptions().dtype(at::kBFloat16).fp32_output(false));
  const at::Tensor features = torch::randn({32, 64});
  const at::Tensor targets = torch::randint(256, {32}, at::kLong);

  const at::Tensor logits = head->forward(features);  // BF16 [32, 256]
  const at::Tensor loss = mixprec::cross_entropy_in_fp32(logits, targets);
  loss.backward();
  const at::Tensor grad = head->named_parameters()["weight"].grad();
  std::cout << "logits " << logits.scalar_type() << ", loss " << loss.scalar_type() << " "
            << loss.item<float>() << ", weight gradient " << grad.scalar_type() << "\n";

  // The same loss as LibTorch's composition on an FP32 copy, to FP32 rounding.
  const float reference = at::cross_entropy_loss(logits.to(at::kFloat), targets).item<float>();
  const bool close = std::abs(loss.item<float>() - reference) <= 1e-5f * std::abs(reference);
  return logits.scalar_type() == at::kBFloat16 && loss.scalar_type() == at::kFloat && close ? 0 : 1;
}
