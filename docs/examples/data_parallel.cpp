// Data parallel with ZeRO-1 on c10d, and a checkpoint every rank writes its shard of.
// Run: torchrun --standalone --nproc-per-node 2 --no-python ./doc_example_data_parallel DIR
// (without torchrun it runs as one rank).
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

int main(int argc, char** argv) {
  namespace distributed = mixprec::distributed;
  const std::filesystem::path root = argc > 1 ? argv[1] : "dp-checkpoints";
  auto ranks = distributed::init_from_env();  // torchrun's RANK, WORLD_SIZE, MASTER_*; Gloo on CPU
  torch::manual_seed(0);                      // every rank builds the same model (checked)
  Net net;
  // Gradients land in buckets that are reduce-scattered during backward; each rank keeps
  // FP32 masters and moments for its 1/N of the elements and all-gathers updated params.
  distributed::GradReducer reducer(
      ranks, *net, distributed::GradReducerOptions().mode(distributed::ReduceMode::kReduceScatter));
  distributed::DistributedOptimizer optimizer(reducer, *net, torch::optim::AdamWOptions(1e-3));
  torch::manual_seed(1 + ranks->rank());  // each rank its own data
  for (int step = 0; step < 3; ++step) {
    reducer.zero_grad();
    net->loss(torch::randn({16, 32})).backward();
    optimizer.update();  // reduce-scatter, step the shard, all-gather
  }
  // Collective: every rank writes its own shard; rank 0 commits once all are durable.
  distributed::save_training_state(root, "step-3", *net, optimizer);
  // Loads on any number of ranks, or in one process with Float16Optimizer.
  Net resumed;
  distributed::GradReducer resumed_reducer(
      ranks, *resumed,
      distributed::GradReducerOptions().mode(distributed::ReduceMode::kReduceScatter));
  distributed::DistributedOptimizer resumed_optimizer(resumed_reducer, *resumed,
                                                      torch::optim::AdamWOptions(1e-3));
  distributed::load_training_state(root, *resumed, resumed_optimizer);
  const int64_t bytes = optimizer.state_bytes(mixprec::optim::ParamRole::kMaster) +
                        optimizer.state_bytes(mixprec::optim::ParamRole::kNativeFp32);
  std::cout << "rank " << ranks->rank() << " of " << ranks->size() << ": " << bytes
            << " bytes of optimizer state\n";
  return at::equal(net->fc->weight, resumed->fc->weight) ? 0 : 1;
}
