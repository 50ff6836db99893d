// A program written against the installed library, as a user would: one include, one target.
// It marks a tensor FP32, converts the rest to BF16 by a precision plan, trains a few AdamW
// steps, saves a training checkpoint, loads it into a fresh model and optimizer, and checks
// that both continue bit for bit alike. Exit status 0 and a last line "downstream: ok".
#include <mixprec/mixprec.h>

#include <cstdio>
#include <filesystem>

namespace {

struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    fc = register_module("fc", mixprec::quant::QuantLinear(16, 16));
    norm_scale = register_parameter("norm_scale", torch::ones({16}));
    router = register_parameter("router", mixprec::keep_in_fp32(torch::randn({4, 16}) * 0.1));
    mixprec::convert_module_to_dtype_except_fp32_marked(
        *this, at::kBFloat16, mixprec::PrecisionPlan().keep_fp32_pattern("norm*"));
  }
  at::Tensor loss(const at::Tensor& x) {
    const at::Tensor h = fc(x.to(at::kBFloat16)).to(at::kFloat) * norm_scale;
    return at::linear(h, router).pow(2).mean();
  }
  mixprec::quant::QuantLinear fc{nullptr};
  at::Tensor norm_scale, router;
};
TORCH_MODULE(Tiny);

void train(Tiny& model, mixprec::optim::Float16Optimizer& optimizer, int steps) {
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    (model->loss(torch::randn({8, 16})) * optimizer.loss_scale()).backward();
    if (!optimizer.update().success) throw std::runtime_error("a step was skipped");
  }
}

bool same_params(const Tiny& a, const Tiny& b) {
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa) {
    if (!at::equal(item.value(), pb[item.key()])) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: downstream CHECKPOINT_ROOT\n");
    return 2;
  }
  const std::filesystem::path root = argv[1];
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);

  at::manual_seed(1);
  Tiny model;
  mixprec::optim::Float16Optimizer optimizer(*model, options);
  train(model, optimizer, 3);
  mixprec::checkpoint::save_training_state(root, "step-3", *model, optimizer);

  at::manual_seed(2);  // a different initialisation: the load must replace all of it
  Tiny resumed;
  mixprec::optim::Float16Optimizer resumed_optimizer(*resumed, options);
  mixprec::checkpoint::load_training_state(root, *resumed, resumed_optimizer);
  if (!same_params(model, resumed)) {
    std::fprintf(stderr, "downstream: loaded parameters differ from the saved ones\n");
    return 1;
  }
  // The load restored the RNG too: the original continues from the saved RNG state, and the
  // resumed copy, loaded again, from the same one.
  train(model, optimizer, 2);
  mixprec::checkpoint::load_training_state(root, *resumed, resumed_optimizer);
  train(resumed, resumed_optimizer, 2);
  if (!same_params(model, resumed)) {
    std::fprintf(stderr, "downstream: the resumed run diverged\n");
    return 1;
  }
  std::printf("router %s, norm_scale %s, fc.weight %s\n",
              c10::toString(resumed->router.scalar_type()),
              c10::toString(resumed->norm_scale.scalar_type()),
              c10::toString(resumed->fc->weight.scalar_type()));
  std::printf("downstream: ok\n");
  return 0;
}
