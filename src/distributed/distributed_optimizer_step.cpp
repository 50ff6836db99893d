// DistributedOptimizer::update: the collective step (see the header for the sequence).
#include "mixprec/distributed/distributed_optimizer.h"

#include "optim/algorithm_traits.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <map>

namespace mixprec::distributed {

using optim::ParamRole;

optim::StepResult DistributedOptimizer::update() {
  optim::StepResult result;
  result.loss_scale = scaler_.scale();
  const double inv_scale = scaler_.inv_scale();
  reducer_.finish();
  Communicator& comm = reducer_.communicator();

  // Local pass over the owned gradient pieces, then one FP64 all-reduce: every rank gets the
  // same global sum of squares and the same overflow verdict before anything changes.
  double sum_of_squares = 0.0;
  double first_non_finite = std::numeric_limits<double>::infinity();  // lowest params_info index
  for (const LocalShard& s : shards_) {
    const optim::GradStats stats = optim::grad_stats(s.grad, inv_scale);
    sum_of_squares += stats.sum_of_squares;
    if (!stats.all_finite) first_non_finite = std::min(first_non_finite, double(s.info));
  }
  const bool local_non_finite = std::isfinite(first_non_finite);
  at::Tensor global = at::tensor(
      {local_non_finite ? 0.0 : sum_of_squares, local_non_finite ? 1.0 : 0.0}, at::kDouble);
  comm.all_reduce_sum(global).wait();
  const double* totals = global.const_data_ptr<double>();
  result.grad_norm = std::sqrt(totals[0]);

  if (totals[1] > 0) {
    if (!scaler_.is_dynamic() && options_.non_finite_grads() == optim::NonFiniteGrads::kError) {
      at::Tensor first = at::tensor({first_non_finite}, at::kDouble);
      comm.all_reduce_min(first).wait();
      const auto index = static_cast<size_t>(first.item<double>());
      TORCH_CHECK(false,
                  "[mixprec::distributed::DistributedOptimizer::update] non-finite gradient in "
                  "parameter '",
                  info_.at(index).fqn,
                  "' (no dynamic loss scaler); the step was not taken on any rank");
    }
    result.grad_norm = std::numeric_limits<double>::infinity();
    scaler_.update(/*found_inf=*/true);
    last_result_ = result;
    return result;
  }

  // Every group's hyper-parameters are checked before any piece is stepped. Every rank
  // holds the same groups, so every rank throws alike.
  for (size_t g = 0; g < param_groups().size(); ++g) {
    const auto& options = param_groups()[g].options();
    TORCH_CHECK(traits_->owns(options),
                "[mixprec::distributed::DistributedOptimizer::update] param group ", g,
                "'s options are not ", traits_->options_name(), " any more");
    const std::string bad = traits_->range_problem(options);
    TORCH_CHECK(bad.empty(), "[mixprec::distributed::DistributedOptimizer::update] param group ", g,
                ": ", bad);
  }
  double multiplier = inv_scale;
  if (options_.clip_grad() > 0 && result.grad_norm > options_.clip_grad()) {
    multiplier *= options_.clip_grad() / (result.grad_norm + 1e-6);
  }
  {
    at::NoGradGuard no_grad;
    if (options_.offload()) {
      step_offloaded(multiplier);
    } else {
      for (LocalShard& s : shards_) step_shard(s, multiplier);
    }
  }
  gather_params();
  scaler_.update(/*found_inf=*/false);
  result.success = true;
  // Every trainable parameter of the groups was stepped, on whichever rank owns its pieces.
  for (size_t i = 0; i < info_.size(); ++i) {
    if (info_[i].role == ParamRole::kFrozen) continue;
    ++steps_[i];
    ++result.params_stepped;
  }
  last_result_ = result;
  return result;
}

void DistributedOptimizer::step_shard(LocalShard& s, double grad_multiplier) {
  const auto& options = param_groups()[info_[s.info].group].options();
  const at::Tensor target = s.master.defined() ? s.master : s.param;
  const at::Tensor model_param = s.master.defined() ? s.param : at::Tensor();
  // The traits' step adds state only once its kernel ran: a throwing kernel leaves none.
  traits_->step(
      options,
      optim::detail::StepArgs{target, s.grad, model_param, steps_[s.info], grad_multiplier},
      s.state);
}

// Every rank contributes its shard of each bucket (the updated values of the pieces it owns,
// zeros in padding) and receives everyone's; each parameter is then copied out whole.
void DistributedOptimizer::gather_params() {
  Communicator& comm = reducer_.communicator();
  if (comm.size() == 1) return;  // the pieces are the parameters, updated in place
  const GradLayout& layout = reducer_.layout();
  at::NoGradGuard no_grad;
  std::map<std::pair<size_t, size_t>, at::Tensor> mine;  // (buffer, bucket) → shard values
  for (const auto& [b, k] : layout.bucket_order) {
    const auto [lo, hi] = layout.shard_range(b, k, comm.rank());
    mine[{b, k}] = at::zeros({hi - lo}, reducer_.grad_buffer(b).options());
  }
  for (const auto& [piece, values] : owned_pieces_) {
    const auto [lo, hi] = layout.shard_range(piece.buffer, piece.bucket, comm.rank());
    mine[{piece.buffer, piece.bucket}]
        .narrow(0, piece.buffer_begin - lo, piece.numel())
        .copy_(values);
  }
  std::vector<std::pair<std::pair<size_t, size_t>, at::Tensor>> gathered;
  std::vector<PendingCollective> pending;
  for (const auto& [b, k] : layout.bucket_order) {
    const BucketSpan& bucket = layout.buffers[b].buckets[k];
    at::Tensor all = at::empty({bucket.numel()}, reducer_.grad_buffer(b).options());
    pending.push_back(comm.all_gather(mine[{b, k}], all));
    gathered.push_back({{b, k}, all});
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    pending[i].wait();
    const auto [b, k] = gathered[i].first;
    const BufferLayout& buf = layout.buffers[b];
    const BucketSpan& bucket = buf.buckets[k];
    for (size_t s : bucket.spans) {
      const ParamSpan& span = buf.spans[s];
      reducer_.param(span.param)
          .detach()
          .view({-1})
          .copy_(gathered[i].second.narrow(0, span.begin - bucket.begin, span.end - span.begin));
    }
  }
}

}  // namespace mixprec::distributed
