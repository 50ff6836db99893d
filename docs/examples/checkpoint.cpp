// Save a training state (model, optimizer, RNG, your metadata) and resume from it.
#include <mixprec/mixprec.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
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

void train(Net& net, mixprec::optim::Float16Optimizer& optimizer, int steps) {
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    net->loss(torch::randn({16, 32})).backward();
    optimizer.update();
  }
}

int main(int argc, char** argv) {
  const std::filesystem::path root = argc > 1 ? argv[1] : "checkpoints";
  const auto adamw = torch::optim::AdamWOptions(1e-3);
  Net net;
  mixprec::optim::Float16Optimizer optimizer(*net, adamw);
  train(net, optimizer, 10);
  // Written to a staging directory, fsynced, renamed into place; then root/latest names it.
  const auto saved = mixprec::checkpoint::save_training_state(root, "step-000010", *net, optimizer,
                                                              {{"epoch", 1}});
  std::cout << "saved " << saved.dir << "\n";

  // In a new process, or here: a fresh model and optimizer take the state of `latest`.
  Net resumed;
  mixprec::optim::Float16Optimizer resumed_optimizer(*resumed, adamw);
  const auto loaded = mixprec::checkpoint::load_training_state(root, *resumed, resumed_optimizer);
  std::cout << "resumed from " << loaded.dir << ", epoch " << loaded.user["epoch"] << "\n";

  // The RNG was restored, so the resumed run draws what the original draws next.
  train(net, optimizer, 5);
  mixprec::checkpoint::load_training_state(root, *resumed, resumed_optimizer);
  train(resumed, resumed_optimizer, 5);
  const bool same =
      at::equal(net->fc->weight, resumed->fc->weight) && at::equal(net->gate, resumed->gate);
  return same ? 0 : 1;
}
