#include "distributed/mp/zero_support.h"

#include "mixprec/checkpoint/format/state_keys.h"
#include "support/remove_tree.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <set>

namespace mixprec::testing {

namespace keys = checkpoint::keys;

torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(2e-2).weight_decay(0.1).amsgrad(true);
}

distributed::GradReducerOptions small_buckets() {
  return distributed::GradReducerOptions().bucket_numel(64).shard_alignment(4);
}

ZeroRun::ZeroRun(optim::Float16OptimizerOptions options) {
  reducer = std::make_unique<distributed::GradReducer>(
      world_ptr(), *model, small_buckets().mode(distributed::ReduceMode::kReduceScatter));
  optimizer = std::make_unique<distributed::DistributedOptimizer>(*reducer, *model, adamw_options(),
                                                                  std::move(options));
}

optim::StepResult ZeroRun::step(int64_t step) {
  reducer->zero_grad();
  model->loss(batch(step)).backward();
  return optimizer->update();
}

Fp16Run::Fp16Run(bool data_parallel) {
  if (data_parallel)
    reducer = std::make_unique<distributed::GradReducer>(world_ptr(), *model, small_buckets());
  optimizer = std::make_unique<optim::Float16Optimizer>(*model, adamw_options());
}

optim::StepResult Fp16Run::step(int64_t step) {
  if (reducer) {
    reducer->zero_grad();
  } else {
    optimizer->zero_grad();
  }
  model->loss(batch(step)).backward();
  if (reducer) reducer->finish();
  return optimizer->update();
}

SharedTempDir::SharedTempDir() {
  std::string mine;
  if (world().rank() == 0) {
    std::string templ =
        (std::filesystem::temp_directory_path() / "mixprec-distributed-XXXXXX").string();
    TORCH_CHECK(::mkdtemp(templ.data()) != nullptr, "mkdtemp failed");
    mine = templ;
  }
  path_ = world().all_gather_strings(mine)[0];
}

SharedTempDir::~SharedTempDir() {
  world().barrier();
  if (world().rank() == 0) {
    remove_tree(path_);
  }
}

void expect_zero_state_equals(const distributed::DistributedOptimizer& zero,
                              const ShardedStateDict& whole, const std::string& what) {
  const ShardedStateDict pieces = zero.sharded_state_dict();
  std::string my_keys;
  for (const auto& [key, piece] : pieces.tensors) {
    my_keys += key + "\n";
    ASSERT_TRUE(piece.flat_range.has_value()) << what << ": " << key;
    auto it = whole.tensors.find(key);
    if (it == whole.tensors.end()) {
      ADD_FAILURE() << what << ": ZeRO-1 has '" << key << "', the reference has not";
      continue;
    }
    EXPECT_EQ(piece.global_shape, it->second.global_shape) << what << ": " << key;
    const at::Tensor expected =
        it->second.flat_elements(piece.flat_range->begin, piece.flat_range->end);
    EXPECT_TRUE(expected.scalar_type() == piece.local.scalar_type() &&
                at::equal(expected, piece.local))
        << what << ": " << key << " [" << piece.flat_range->begin << ", " << piece.flat_range->end
        << ")";
  }
  std::set<std::string> union_keys;
  for (const std::string& list : world().all_gather_strings(my_keys)) {
    size_t start = 0;
    for (size_t end; (end = list.find('\n', start)) != std::string::npos; start = end + 1) {
      union_keys.insert(list.substr(start, end - start));
    }
  }
  std::set<std::string> expected_keys;
  for (const auto& [key, t] : whole.tensors) {
    if (keys::is_optimizer_key(key)) expected_keys.insert(key);
  }
  EXPECT_EQ(union_keys, expected_keys) << what;
  const std::string field(keys::kCommonOptimizer);
  EXPECT_EQ(pieces.common.at(field).dump(), whole.common.at(field).dump()) << what;
}

void expect_params_equal(torch::nn::Module& a, torch::nn::Module& b, const std::string& what,
                         bool bitwise) {
  auto theirs = b.named_parameters();
  for (const auto& item : a.named_parameters()) {
    EXPECT_TRUE(equal_or_close(item.value(), theirs[item.key()], bitwise))
        << what << ": " << item.key();
  }
}

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

}  // namespace mixprec::testing
