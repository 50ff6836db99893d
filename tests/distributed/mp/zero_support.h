// Shared by the ZeRO-1 checkpoint tests: training setups over MixedNet (mp_support.h) with the
// same gradients on every rank (batch(step) everywhere: the averaged gradient is then exact,
// see grad_reducer.h), a checkpoint root every rank sees, and state comparisons.
#pragma once

#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/optim/float16_optimizer.h"

#include <torch/optim/adamw.h>

#include <filesystem>
#include <memory>
#include <string>

namespace mixprec::testing {

// AdamW with weight decay and amsgrad (every Adam state kind is held).
torch::optim::AdamWOptions adamw_options();
// Small buckets, alignment 4: shard boundaries fall inside parameters.
distributed::GradReducerOptions small_buckets();

// ZeRO-1 on every rank of world().
struct ZeroRun {
  MixedNet model;
  std::unique_ptr<distributed::GradReducer> reducer;
  std::unique_ptr<distributed::DistributedOptimizer> optimizer;
  explicit ZeroRun(optim::Float16OptimizerOptions options = {});
  optim::StepResult step(int64_t step);  // batch(step), the same on every rank
};

// One Float16Optimizer over a MixedNet: with a GradReducer (all-reduce) this is plain data
// parallelism on every rank of world(); without, a single process.
struct Fp16Run {
  MixedNet model;
  std::unique_ptr<distributed::GradReducer> reducer;
  std::unique_ptr<optim::Float16Optimizer> optimizer;
  explicit Fp16Run(bool data_parallel);
  optim::StepResult step(int64_t step);
};

// A directory every rank sees (rank 0 makes it, all learn its name); rank 0 removes it at
// scope exit after a barrier. Collective at construction and destruction.
class SharedTempDir {
 public:
  SharedTempDir();
  ~SharedTempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Bitwise: every piece of ZeRO-1's sharded state equals those elements of `whole` (a
// Float16Optimizer's state), every key of `whole` is some rank's, and common["optimizer"] is
// identical. Collective (the key sets are all-gathered). Reports with EXPECT_*.
void expect_zero_state_equals(const distributed::DistributedOptimizer& zero,
                              const ShardedStateDict& whole, const std::string& what);
// Every parameter of `a` equals `b`'s, bitwise, with the same dtype.
void expect_params_equal(torch::nn::Module& a, torch::nn::Module& b, const std::string& what,
                         bool bitwise = true);

// An environment variable, or "".
std::string env_or_empty(const char* name);

}  // namespace mixprec::testing
