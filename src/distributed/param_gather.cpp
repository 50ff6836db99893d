// GradReducer's parameter gathers (ZeRO-1): after a step, every rank's updated shard of each
// bucket reaches every rank, in place in the parameter buffers that the parameters are views
// of: one in-place all-gather per bucket (Communicator::all_gather).
#include "mixprec/distributed/grad_reducer.h"

#include "distributed/grad_reducer_state.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>

namespace mixprec::distributed {

void GradReducer::State::wait_bucket_gather(size_t bucket) {
  if (!gathers[bucket].pending()) return;
  const auto t0 = std::chrono::steady_clock::now();
  gathers[bucket].wait();
  gather_waited[bucket] = 1;
  timing.param_gather_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void GradReducer::State::wait_all_gathers() {
  for (size_t b = 0; b < buckets.size(); ++b) wait_bucket_gather(b);
}

void GradReducer::start_param_gather() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.comm->check_usable("mixprec::distributed::GradReducer::start_param_gather");
  TORCH_CHECK(s.options.mode() == ReduceMode::kReduceScatter,
              "[mixprec::distributed::GradReducer::start_param_gather] only a kReduceScatter "
              "reducer's ranks hold parts of the parameters");
  s.wait_all_gathers();
  s.timing.param_gather_wait_seconds = 0.0;
  Communicator& comm = *s.comm;
  if (comm.size() == 1) return;  // the one piece is every parameter, updated in place
  // The gather writes every parameter through the buffer, not through the parameter: bump
  // each one's version counter, as an in-place write would, so that whatever caches a value
  // derived from a parameter (a quantized weight, the optimizer's record) sees the change.
  for (const at::Tensor& p : s.params) p.unsafeGetTensorImpl()->bump_version();
  // Forward order: the buffers run in reverse model order, so the last bucket of the launch
  // order holds the first layers.
  for (auto it = s.order.rbegin(); it != s.order.rend(); ++it) {
    State::Bucket& bucket = s.buckets[*it];
    s.gathers[*it] =
        comm.all_gather(bucket.shards[static_cast<size_t>(comm.rank())], bucket.params_range);
    s.gather_waited[*it] = 0;
  }
  if (!s.options.overlap_param_gather()) s.wait_all_gathers();
}

void GradReducer::wait_for_params(const torch::nn::Module& module) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.comm->check_usable("mixprec::distributed::GradReducer::wait_for_params");
  auto cached = s.module_buckets.find(&module);
  if (cached == s.module_buckets.end()) {
    std::vector<size_t> ids;
    for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
      auto it = s.index.find(p.unsafeGetTensorImpl());
      if (it != s.index.end()) ids.push_back(s.bucket_id[it->second]);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    cached = s.module_buckets.emplace(&module, std::move(ids)).first;
  }
  for (size_t b : cached->second) s.wait_bucket_gather(b);
}

void GradReducer::wait_param_gather() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.comm->check_usable("mixprec::distributed::GradReducer::wait_param_gather");
  s.wait_all_gathers();
}

}  // namespace mixprec::distributed
