// GradReducer: construction (model check, buffers, broadcast), backward's hooks and finish().
// Parameter gathers are in param_gather.cpp.
#include "mixprec/distributed/grad_reducer.h"

#include "distributed/grad_reducer_state.h"
#include "mixprec/distributed/model_check.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <unordered_set>

namespace mixprec::distributed {

namespace {

constexpr const char* kReducer = "mixprec::distributed::GradReducer";

struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  ReadyHook(std::weak_ptr<GradReducer::State> state, size_t index)
      : state(std::move(state)), index(index) {}
  void operator()(const torch::autograd::Variable& /*param*/) override {
    if (auto s = state.lock()) s->on_grad_ready(index);
  }
  std::weak_ptr<GradReducer::State> state;
  size_t index;
};

// Sends rank 0's value of `t` (any dtype, any layout) to every rank, in place.
void broadcast_in_place(Communicator& comm, const at::Tensor& t) {
  if (t.numel() == 0) return;
  at::NoGradGuard no_grad;
  const at::Tensor dense = t.is_contiguous() ? t : t.contiguous();
  comm.broadcast(dense.reshape({-1}).view(at::kByte), 0).wait();
  if (!dense.is_same(t)) t.copy_(dense);
}

// A tensor of `shape` on `buffer`'s storage from element `begin`: the same memory as a view,
// but not an autograd view (see grad_views).
at::Tensor alias_of(const at::Tensor& buffer, int64_t begin, at::IntArrayRef shape) {
  at::Tensor alias = at::empty({0}, buffer.options());
  alias.set_(buffer.storage(), buffer.storage_offset() + begin, shape,
             c10::contiguous_strides(shape));
  return alias;
}

}  // namespace

void GradReducer::State::count_waiting() {
  std::fill(waiting.begin(), waiting.end(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].requires_grad()) ++waiting[bucket_id[i]];
  }
  counted = true;
}

void GradReducer::State::reset_step() {
  std::fill(ready.begin(), ready.end(), 0);
  std::fill(arrival.begin(), arrival.end(), -1);
  std::fill(launched_at.begin(), launched_at.end(), -1);
  arrivals = 0;
  next = 0;
  counted = false;  // counted at the step's first gradient: freezing may change before it
}

bool GradReducer::State::grad_is_adopted(size_t i) const {
  const at::Tensor& grad = params[i].grad();
  const at::Tensor& view = grad_views[i];
  return grad.defined() && grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
         grad.strides() == view.strides() && grad.scalar_type() == view.scalar_type();
}

// Makes params[i].grad its buffer range again, keeping the value it has (or zero).
void GradReducer::State::adopt_grad(size_t i) {
  if (grad_is_adopted(i)) return;
  at::Tensor& grad = params[i].mutable_grad();
  const at::Tensor& view = grad_views[i];
  at::NoGradGuard no_grad;
  if (grad.defined()) {
    view.copy_(grad);
  } else {
    view.zero_();
  }
  grad = view;
}

void GradReducer::State::accumulate_fp32(size_t i, bool restart) {
  at::NoGradGuard no_grad;
  at::Tensor converted = scratch.narrow(0, 0, fp32_views[i].numel());
  converted.copy_(grad_views[i].view({-1}));
  if (restart || rounded[i]) {
    fp32_views[i].copy_(converted);
  } else {
    fp32_views[i].add_(converted);
  }
  rounded[i] = 0;
  grad_views[i].zero_();
}

bool GradReducer::State::unchanged_since_finish() const {
  if (finished_without_gradients) return false;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool adopted = grad_is_adopted(i);
    const bool none = !params[i].grad().defined();
    if (adopted_at_finish[i] ? !adopted : !none) return false;
    if (params[i]._version() != versions_at_finish[i]) return false;
  }
  return true;
}

void GradReducer::State::restart_after_finish() {
  if (options.accumulate_in_fp32() && options.mode() == ReduceMode::kReduceScatter) {
    for (at::Tensor& buffer : fp32_buffers) {
      if (buffer.defined()) buffer.zero_();
    }
  }
  finished = false;
}

// What one process's optimizer would see: no .grad (cleared from outside, e.g. by an
// optimizer's zero_grad() setting it to none) is no gradient, and its range sends zeros; a
// .grad set from outside is a gradient; the buffer's own .grad keeps what it had.
void GradReducer::State::settle(size_t i) {
  const bool cleared = !params[i].grad().defined();
  const bool replaced = !cleared && !grad_is_adopted(i);
  if (cleared) got[i] = 0;
  if (replaced) got[i] = 1;
  if (cleared || replaced) stale[i] = 0;
  adopt_grad(i);
  if (fp32_views[i].defined() && options.accumulate_in_fp32()) {
    if (cleared) {
      fp32_views[i].zero_();
      rounded[i] = 0;
    } else {
      accumulate_fp32(i, /*restart=*/replaced);
    }
  }
}

void GradReducer::State::clear_unused_everywhere() {
  const int64_t n = static_cast<int64_t>(params.size());
  // A sum of FP32 counts (exact to 2^24 ranks): small sums are Gloo's cheapest collective.
  float* flags = any_rank_got.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) flags[i] = got[i];
  if (comm->size() > 1) comm->all_reduce_sum(any_rank_got).wait();
  for (int64_t i = 0; i < n; ++i) {
    if (!flags[i]) params[i].mutable_grad().reset();
  }
}

void GradReducer::State::start(size_t position) {
  RECORD_USER_SCOPE("mixprec::bucket_start");  // a named range in profiler traces
  Bucket& bucket = buckets[order[position]];
  at::NoGradGuard no_grad;
  for (size_t i : bucket.params) {
    if (!ready[i]) settle(i);
  }
  if (bucket.copy_in) bucket.send.copy_(bucket.grads);
  PendingCollective& flight = flights[order[position]];
  if (options.mode() == ReduceMode::kAllReduce || !comm->has_native_reduce_scatter()) {
    flight = comm->all_reduce_sum(bucket.send);
  } else {
    flight = comm->reduce_scatter_sum(bucket.send, bucket.reduced);
  }
}

void GradReducer::State::on_grad_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mutex);
  comm->check_usable(kReducer);
  const size_t b = bucket_id[i];
  TORCH_CHECK(!gathers[b].pending() || gather_waited[b], "[", kReducer, "] the gradient of '",
              layout.params[i].fqn,
              "' arrived while its all-gather was never waited for: forward read it as it was "
              "being written. Call wait_for_params(module) before a module's forward, or turn "
              "overlap_param_gather off");
  // Autograd has just added this gradient into the .grad: where that is a buffer range whose
  // reduction is in flight, the collective reads (or writes) it meanwhile, and what each rank
  // ends up with is anyone's guess. Nothing can repair that: the group is failed for good.
  // (Or, had .grad been replaced, adopting it would copy into that buffer now.)
  if (flights[b].pending()) {
    const std::string message =
        std::string("[") + kReducer + "] the gradient of '" + layout.params[i].fqn +
        "' arrived while its bucket's reduction was in flight (a second backward before "
        "finish()); the ranks' gradients can no longer agree. Call finish() after each "
        "backward, or accumulate micro-batches inside a NoSyncGuard";
    comm->fail(message);
    TORCH_CHECK(false, message);
  }
  if (stale[i]) {
    TORCH_CHECK(!grad_is_adopted(i), "[", kReducer, "] the gradient of '", layout.params[i].fqn,
                "' would be added to the last step's: after finish() in reduce-scatter mode a "
                ".grad holds the average only in this rank's shard, so gradients cannot carry "
                "over into the next step. Call zero_grad() (or clear the .grad tensors) before "
                "the step's first backward, or reduce with ReduceMode::kAllReduce");
    stale[i] = 0;  // cleared or replaced since: this gradient starts afresh
  }
  // A backward after finish() without zero_grad() (gradients cleared some other way, e.g.
  // torch's Optimizer::zero_grad()).
  if (finished) restart_after_finish();
  // Whether autograd accumulated in place or made a new .grad (create_graph does), the .grad
  // holds what its buffer range held (zeros, or the rounded average: `rounded`) plus this
  // backward's gradient: added to the FP32 range as it is.
  adopt_grad(i);
  if (fp32_views[i].defined() && options.accumulate_in_fp32()) {
    accumulate_fp32(i, /*restart=*/false);
  }
  got[i] = 1;
  finished = false;
  if (!sync) return;
  TORCH_CHECK(!ready[i], "[", kReducer, "] the gradient of '", layout.params[i].fqn,
              "' arrived twice before finish(): call finish() after each backward, or "
              "accumulate micro-batches inside a NoSyncGuard");
  if (!counted) count_waiting();
  ready[i] = 1;
  arrival[i] = arrivals++;
  TORCH_CHECK(waiting[b] > 0, "[", kReducer, "] the gradient of '", layout.params[i].fqn,
              "' arrived after its bucket's reduction started (made trainable during backward?)");
  --waiting[b];
  if (!options.overlap()) return;
  while (next < order.size() && bucket_complete(next)) {
    launched_at[order[next]] = arrivals;
    start(next++);
  }
}

// After the first reduced step: every rank takes the order in which rank 0 saw buckets
// complete (by the arrival of their last gradient; a bucket missing a gradient goes last).
void GradReducer::State::agree_on_order() {
  // Collective whenever overlap is on: a rank whose backward reached nothing this step (an
  // empty micro-batch, .grad set from outside) must not skip the broadcast the others make.
  // Rank 0's arrivals decide, on every rank, whether this step's order is worth taking.
  if (!options.overlap()) {
    order_agreed = true;
    return;
  }
  std::vector<std::pair<int64_t, size_t>> completion;  // (last arrival, bucket)
  for (size_t position = 0; position < order.size(); ++position) {
    const size_t id = order[position];
    int64_t last = -1;
    for (size_t i : buckets[id].params) {
      if (!params[i].requires_grad()) continue;
      last = arrival[i] < 0 ? INT64_MAX : std::max(last, arrival[i]);
      if (last == INT64_MAX) break;
    }
    completion.emplace_back(last, id);
  }
  std::stable_sort(completion.begin(), completion.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  // [rank 0 saw gradients arrive, the order...]
  at::Tensor agreed = at::empty({static_cast<int64_t>(order.size()) + 1}, at::kLong);
  auto* flag = agreed.mutable_data_ptr<int64_t>();
  flag[0] = arrivals > 0;
  int64_t* ids = flag + 1;
  for (size_t j = 0; j < completion.size(); ++j)
    ids[j] = static_cast<int64_t>(completion[j].second);
  comm->broadcast(agreed, 0).wait();
  order_agreed = flag[0] != 0;  // else: no order seen yet, agree after a later step
  if (!order_agreed) return;
  for (size_t j = 0; j < order.size(); ++j) {
    TORCH_INTERNAL_ASSERT(ids[j] >= 0 && static_cast<size_t>(ids[j]) < buckets.size());
    order[j] = static_cast<size_t>(ids[j]);
  }
}

bool GradReducer::reduces(c10::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

GradReducer::GradReducer(std::shared_ptr<Communicator> comm, torch::nn::Module& model,
                         GradReducerOptions options)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(comm, "[", kReducer, "] the communicator is null");
  comm->check_usable(kReducer);
  TORCH_CHECK(options.bucket_numel() > 0 && options.shard_alignment() > 0, "[", kReducer,
              "] bucket_numel and shard_alignment must be > 0, got ", options.bucket_numel(),
              " and ", options.shard_alignment());
  // First, so that ranks holding different models all fail here with the same message.
  check_same_model(*comm, model);

  State& s = *state_;
  s.comm = std::move(comm);
  s.options = options;
  if (s.options.accumulate_in_fp32()) s.options.grad_reduce_in_fp32(true);
  std::vector<LayoutParam> entries;
  std::vector<at::Tensor> other_params;  // not floating: broadcast only
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (!reduces(p.scalar_type())) {
      TORCH_CHECK(!p.requires_grad(), "[", kReducer, "] '", item.key(), "' is a trainable ",
                  p.scalar_type(),
                  " parameter; gradients are reduced for Float, BFloat16 and Half");
      other_params.push_back(p);
      continue;
    }
    TORCH_CHECK(p.layout() == at::kStrided && p.is_contiguous(), "[", kReducer, "] '", item.key(),
                "' must be dense and contiguous");
    TORCH_CHECK(s.params.empty() || p.device() == s.params.front().device(), "[", kReducer, "] '",
                item.key(), "' is on ", p.device(), ", '", entries.front().fqn, "' on ",
                s.params.front().device(), "; one reducer serves one device");
    // A parameter registered frozen has no autograd metadata yet, where its hook lives (it is
    // hooked all the same: unfreezing it later needs no new reducer).
    torch::autograd::impl::materialize_autograd_meta(p);
    TORCH_CHECK(torch::autograd::impl::post_acc_grad_hooks(p) == nullptr, "[", kReducer, "] '",
                item.key(),
                "' already has a post-accumulate-grad hook (is another GradReducer attached?)");
    entries.push_back(LayoutParam{item.key(), p.sizes().vec(), p.scalar_type()});
    s.index.emplace(p.unsafeGetTensorImpl(), s.params.size());
    s.params.push_back(p);
  }
  const int world = s.comm->size(), rank = s.comm->rank();
  s.layout = make_grad_layout(std::move(entries), world,
                              {options.bucket_numel(), options.shard_alignment()});

  at::NoGradGuard no_grad;
  const c10::Device device = s.params.empty() ? c10::Device(at::kCPU) : s.params[0].device();
  const size_t n = s.params.size();
  s.param_views.resize(n);
  s.grad_views.resize(n);
  s.fp32_views.resize(n);
  s.pieces.resize(n);
  s.bucket_id.resize(n);
  for (size_t b = 0; b < s.layout.buffers.size(); ++b) {
    const BufferLayout& buf = s.layout.buffers[b];
    const auto on = [&](at::ScalarType dtype) { return at::TensorOptions(dtype).device(device); };
    s.param_buffers.push_back(at::zeros({buf.numel}, on(buf.dtype)));
    s.grad_buffers.push_back(at::zeros({buf.numel}, on(buf.dtype)));
    const bool fp32 = buf.dtype != at::kFloat && s.options.grad_reduce_in_fp32();
    s.fp32_buffers.push_back(fp32 ? at::zeros({buf.numel}, on(at::kFloat)) : at::Tensor());
    for (const ParamSpan& span : buf.spans) {
      const auto& shape = s.layout.params[span.param].shape;
      const int64_t length = span.end - span.begin;
      s.param_views[span.param] = s.param_buffers[b].narrow(0, span.begin, length).view(shape);
      s.grad_views[span.param] = alias_of(s.grad_buffers[b], span.begin, shape);
      if (fp32) s.fp32_views[span.param] = s.fp32_buffers[b].narrow(0, span.begin, length);
    }
  }
  int64_t largest_half = 0;
  for (size_t i = 0; i < n; ++i) {
    if (s.fp32_views[i].defined()) largest_half = std::max(largest_half, s.fp32_views[i].numel());
  }
  if (s.options.accumulate_in_fp32() && largest_half > 0) {
    s.scratch = at::empty({largest_half}, at::TensorOptions(at::kFloat).device(device));
  }
  // Parameters become views of the parameter buffers, with their values.
  for (size_t i = 0; i < n; ++i) {
    s.param_views[i].copy_(s.params[i].detach());
    s.params[i].set_data(s.param_views[i]);
  }
  // Rank 0's weights everywhere (the model check made sure every rank has the same shapes);
  // without the broadcast, weights that differ are an error naming the tensor.
  if (world > 1 && options.broadcast_from_rank0()) {
    for (const at::Tensor& buffer : s.param_buffers) s.comm->broadcast(buffer, 0).wait();
    for (const at::Tensor& p : other_params) broadcast_in_place(*s.comm, p);
    for (const auto& item : model.named_buffers(/*recurse=*/true)) {
      if (item.value().defined()) broadcast_in_place(*s.comm, item.value());
    }
  } else if (world > 1) {
    check_same_values(*s.comm, model);
  }

  for (size_t b = 0; b < s.layout.buffers.size(); ++b) {
    const BufferLayout& buf = s.layout.buffers[b];
    for (size_t k = 0; k < buf.buckets.size(); ++k) {
      const BucketSpan& span = buf.buckets[k];
      State::Bucket bucket;
      bucket.buffer = b;
      bucket.index = k;
      for (size_t sp : span.spans) bucket.params.push_back(buf.spans[sp].param);
      bucket.grads = s.grad_buffers[b].narrow(0, span.begin, span.numel());
      const bool fp32 = s.fp32_buffers[b].defined();
      bucket.send = fp32 ? s.fp32_buffers[b].narrow(0, span.begin, span.numel()) : bucket.grads;
      bucket.copy_in = fp32 && !s.options.accumulate_in_fp32();
      // kAllReduce serves any optimizer, which reads .grad: the FP32 average is rounded back
      // into it even when accumulating in FP32 (DistributedOptimizer reads main_grad()).
      const auto [lo, hi] = s.layout.shard_range(b, k, rank);
      const bool shard_only = options.mode() == ReduceMode::kReduceScatter;
      bucket.reduced = shard_only ? bucket.send.narrow(0, lo - span.begin, hi - lo) : bucket.send;
      if (bucket.copy_in || (fp32 && !shard_only)) {
        bucket.round_to =
            shard_only ? bucket.grads.narrow(0, lo - span.begin, hi - lo) : bucket.grads;
      }
      bucket.world_size = at::scalar_tensor(static_cast<double>(world), bucket.send.options());
      bucket.params_range = s.param_buffers[b].narrow(0, span.begin, span.numel());
      const int64_t shard = span.numel() / world;
      for (int r = 0; r < world; ++r) {
        bucket.shards.push_back(bucket.params_range.narrow(0, r * shard, shard));
      }
      for (size_t i : bucket.params) s.bucket_id[i] = s.buckets.size();
      s.buckets.push_back(std::move(bucket));
    }
  }
  std::vector<std::vector<size_t>> id_of(s.layout.buffers.size());
  for (size_t id = 0; id < s.buckets.size(); ++id) id_of[s.buckets[id].buffer].push_back(id);
  for (const auto& [b, k] : s.layout.bucket_order) s.order.push_back(id_of[b][k]);
  for (const ParamShard& piece : s.layout.param_shards(rank)) {
    s.pieces[piece.param] = FlatRange{piece.begin, piece.end};
  }
  if (options.mode() == ReduceMode::kAllReduce) {
    for (size_t i = 0; i < n; ++i) s.pieces[i] = FlatRange{0, s.params[i].numel()};
  }

  s.got.assign(n, 0);
  s.rounded.assign(n, 0);
  s.any_rank_got = at::zeros({static_cast<int64_t>(n)}, at::kFloat);
  s.ready.assign(n, 0);
  s.stale.assign(n, 0);
  s.adopted_at_finish.assign(n, 0);
  s.versions_at_finish.assign(n, 0);
  s.arrival.assign(n, -1);
  s.waiting.assign(s.buckets.size(), 0);
  s.flights.resize(s.buckets.size());
  s.launched_at.assign(s.buckets.size(), -1);
  s.gathers.resize(s.buckets.size());
  s.gather_waited.assign(s.buckets.size(), 1);
  s.reset_step();
  s.timing.buckets = static_cast<int64_t>(s.buckets.size());
  for (size_t i = 0; i < n; ++i) {
    s.adopt_grad(i);
    auto hook = std::make_unique<ReadyHook>(state_, i);
    s.hooks.push_back(hook.get());
    torch::autograd::impl::set_post_acc_grad_hooks(s.params[i], std::move(hook));
  }
}

GradReducer::~GradReducer() {
  State& s = *state_;
  for (size_t i = 0; i < s.hooks.size(); ++i) {
    auto& installed = torch::autograd::impl::post_acc_grad_hooks(s.params[i]);
    if (installed.get() == s.hooks[i]) installed.reset();
  }
}

void GradReducer::zero_grad() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.comm->check_usable("mixprec::distributed::GradReducer::zero_grad");
  TORCH_CHECK(s.next == 0, "[mixprec::distributed::GradReducer::zero_grad] ", s.next,
              " bucket reduction(s) are in flight; call finish() first");
  at::NoGradGuard no_grad;
  for (at::Tensor& buffer : s.grad_buffers) buffer.zero_();
  for (at::Tensor& buffer : s.fp32_buffers) {
    if (buffer.defined()) buffer.zero_();
  }
  for (size_t i = 0; i < s.params.size(); ++i) s.adopt_grad(i);
  std::fill(s.got.begin(), s.got.end(), 0);
  std::fill(s.rounded.begin(), s.rounded.end(), 0);
  s.reset_step();
  s.finished = false;
  std::fill(s.stale.begin(), s.stale.end(), 0);
}

void GradReducer::finish() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.comm->check_usable("mixprec::distributed::GradReducer::finish");
  TORCH_CHECK(s.sync, "[mixprec::distributed::GradReducer::finish] called inside a NoSyncGuard");
  // Already reduced, nothing changed since: averaging again would change the gradients.
  if (s.finished && s.unchanged_since_finish()) return;
  // A parameter no backward reached since the last finish() whose .grad is still in its
  // buffer would be reduced again from what that finish() left there. Checked before anything
  // changes, so that the error leaves the reducer as it found it.
  for (size_t i = 0; i < s.params.size(); ++i) {
    TORCH_CHECK(!s.stale[i] || !s.params[i].requires_grad() || !s.grad_is_adopted(i),
                "[mixprec::distributed::GradReducer::finish] the gradient of '",
                s.layout.params[i].fqn,
                "' is the last step's: in reduce-scatter mode it cannot be reduced again. "
                "Call zero_grad() (or clear the .grad tensors) before the step's first backward");
  }
  // Finished, and a .grad was cleared or replaced since (torch's Optimizer::zero_grad(), say),
  // or a parameter written (an optimizer step), and no backward ran on this rank — an empty
  // micro-batch: a new step, whose collectives the ranks that had a backward start too.
  // Returning would leave them paired with this rank's next step's.
  if (s.finished) s.restart_after_finish();
  RECORD_USER_SCOPE("mixprec::bucket_finish");
  const auto t0 = std::chrono::steady_clock::now();
  s.wait_all_gathers();
  if (!s.counted) s.count_waiting();
  at::NoGradGuard no_grad;
  try {
    while (s.next < s.order.size()) s.start(s.next++);  // settles what no backward reached
  } catch (const std::exception& e) {
    // A .grad set from outside that cannot be taken (another shape): this rank stops short of
    // collectives the others start, so the group cannot be used again.
    s.comm->fail(std::string("GradReducer::finish failed before starting every bucket: ") +
                 e.what());
    throw;
  }
  const int n = s.comm->size();
  int64_t during_backward = 0;
  for (size_t id = 0; id < s.buckets.size(); ++id) {
    State::Bucket& bucket = s.buckets[id];
    s.flights[id].wait();
    if (n > 1) bucket.reduced.div_(bucket.world_size);
    if (bucket.round_to.defined()) bucket.round_to.copy_(bucket.reduced);
    if (s.launched_at[id] >= 0 && s.launched_at[id] < s.arrivals) ++during_backward;
  }
  if (s.options.mode() == ReduceMode::kAllReduce) {
    if (s.options.accumulate_in_fp32()) {
      for (size_t i = 0; i < s.params.size(); ++i) s.rounded[i] = s.fp32_views[i].defined();
    }
    s.clear_unused_everywhere();
  }
  s.timing.launched_during_backward = during_backward;
  if (!s.order_agreed) s.agree_on_order();
  s.reset_step();
  s.finished = true;
  std::fill(s.stale.begin(), s.stale.end(), s.options.mode() == ReduceMode::kReduceScatter);
  s.finished_without_gradients = true;
  for (size_t i = 0; i < s.params.size(); ++i) {
    s.adopted_at_finish[i] = s.grad_is_adopted(i);
    s.versions_at_finish[i] = static_cast<int64_t>(s.params[i]._version());
    if (s.params[i].grad().defined()) s.finished_without_gradients = false;
  }
  s.timing.finish_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

GradReducer::NoSyncGuard::NoSyncGuard(GradReducer& reducer) : reducer_(reducer) {
  std::lock_guard<std::mutex> lock(reducer_.state_->mutex);
  // Gradients accumulated now would land in buffers being reduced.
  TORCH_CHECK(reducer_.state_->next == 0, "[mixprec::distributed::GradReducer::NoSyncGuard] ",
              reducer_.state_->next,
              " bucket reduction(s) of a synchronized backward are in flight; call finish() "
              "before accumulating without synchronization");
  previous_ = reducer_.state_->sync;
  reducer_.state_->sync = false;
}

GradReducer::NoSyncGuard::~NoSyncGuard() {
  std::lock_guard<std::mutex> lock(reducer_.state_->mutex);
  reducer_.state_->sync = previous_;
}

const GradLayout& GradReducer::layout() const { return state_->layout; }
const GradReducerOptions& GradReducer::options() const { return state_->options; }
Communicator& GradReducer::communicator() const { return *state_->comm; }

const at::Tensor& GradReducer::grad_buffer(size_t index) const {
  TORCH_CHECK(index < state_->grad_buffers.size(), "[", kReducer, "::grad_buffer] no buffer ",
              index);
  return state_->grad_buffers[index];
}

const at::Tensor& GradReducer::param_buffer(size_t index) const {
  TORCH_CHECK(index < state_->param_buffers.size(), "[", kReducer, "::param_buffer] no buffer ",
              index);
  return state_->param_buffers[index];
}

const at::Tensor& GradReducer::param(size_t index) const {
  TORCH_CHECK(index < state_->params.size(), "[", kReducer, "::param] no parameter ", index);
  return state_->params[index];
}

size_t GradReducer::index_of(const at::Tensor& param) const {
  if (!param.defined()) return kNoParam;
  auto it = state_->index.find(param.unsafeGetTensorImpl());
  return it == state_->index.end() ? kNoParam : it->second;
}

FlatRange GradReducer::piece_of(size_t index) const { return state_->pieces.at(index); }

bool GradReducer::got_gradient(size_t index) const { return state_->got.at(index) != 0; }

at::Tensor GradReducer::reduced_gradient(size_t index) const {
  const State& s = *state_;
  if (s.options.accumulate_in_fp32() && s.fp32_views.at(index).defined()) {
    return s.fp32_views[index];
  }
  return s.grad_views.at(index).view({-1});
}

at::Tensor GradReducer::main_grad(size_t index) const {
  const State& s = *state_;
  if (!s.options.accumulate_in_fp32() || !s.fp32_views.at(index).defined()) return {};
  return s.fp32_views[index].view(s.layout.params[index].shape);
}

void GradReducer::reseat_params() {
  State& s = *state_;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const at::Tensor& p = s.params[i];
    const at::Tensor& view = s.param_views[i];
    if (p.const_data_ptr() == view.const_data_ptr() || p.scalar_type() != view.scalar_type() ||
        p.sizes() != view.sizes()) {
      continue;  // in place; or re-typed or re-shaped, which the optimizer refuses by name
    }
    view.copy_(p.detach());
    at::Tensor(p).set_data(view);
    // A new value through the parameter: its version moves, as an in-place write's would.
    p.unsafeGetTensorImpl()->bump_version();
    // Not a new step, though: the value is the one the step's finish() saw, now in the buffer
    // (the optimizer's update() reseats between the caller's finish() and its own).
    if (s.finished) s.versions_at_finish[i] = static_cast<int64_t>(p._version());
  }
}

const ReductionTiming& GradReducer::last_timing() const { return state_->timing; }

}  // namespace mixprec::distributed
