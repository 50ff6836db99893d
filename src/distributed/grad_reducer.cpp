#include "mixprec/distributed/grad_reducer.h"

#include "mixprec/distributed/model_check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <chrono>
#include <mutex>
#include <unordered_set>

namespace mixprec::distributed {

struct GradReducer::State {
  std::shared_ptr<Communicator> comm;
  GradReducerOptions options;
  GradLayout layout;
  std::vector<at::Tensor> params;  // layout.params order
  std::vector<at::Tensor> views;   // per param: its range of its buffer, in its shape
  std::vector<std::pair<size_t, size_t>> bucket_of;  // per param: (buffer, bucket)
  std::vector<at::Tensor> buffers;
  std::vector<const torch::autograd::PostAccumulateGradHook*> hooks;  // ours, per param

  std::mutex mutex;
  bool sync = true;
  bool finished = false;  // finish() ran and no gradient arrived since (nor zero_grad())
  // One step's progress.
  std::vector<char> ready;                    // per param: gradient arrived
  std::vector<std::vector<int64_t>> waiting;  // per buffer, bucket: params not arrived
  size_t next = 0;                            // next entry of layout.bucket_order to start
  int64_t started_in_backward = 0;            // buckets started from a hook
  struct InFlight {
    PendingCollective work;
    at::Tensor reduced;  // what the collective leaves summed: the bucket, or this rank's shard
    at::Tensor target;   // the grad-buffer range to round `reduced` into (FP32 reduction only)
  };
  std::vector<InFlight> in_flight;  // by position in layout.bucket_order
  ReductionTiming timing;

  void reset_step() {
    std::fill(ready.begin(), ready.end(), 0);
    for (size_t b = 0; b < waiting.size(); ++b) {
      for (size_t k = 0; k < waiting[b].size(); ++k) {
        waiting[b][k] = static_cast<int64_t>(layout.buffers[b].buckets[k].spans.size());
      }
    }
    next = 0;
    started_in_backward = 0;
    in_flight.assign(layout.bucket_order.size(), {});
  }

  // Makes params[i].grad its buffer view again, keeping the value it has (or zero).
  void adopt_grad(size_t i) {
    at::Tensor& grad = params[i].mutable_grad();
    const at::Tensor& view = views[i];
    if (grad.defined() && grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
        grad.strides() == view.strides() && grad.scalar_type() == view.scalar_type()) {
      return;
    }
    at::NoGradGuard no_grad;
    if (grad.defined()) {
      view.copy_(grad);
    } else {
      view.zero_();
    }
    grad = view;
  }

  void start(size_t position) {
    const auto [b, k] = layout.bucket_order[position];
    const BucketSpan& bucket = layout.buffers[b].buckets[k];
    at::NoGradGuard no_grad;
    at::Tensor grads = buffers[b].narrow(0, bucket.begin, bucket.numel());
    const bool upcast = options.grad_reduce_in_fp32() && grads.scalar_type() != at::kFloat;
    at::Tensor send = upcast ? grads.to(at::kFloat) : grads;
    InFlight& f = in_flight[position];
    if (options.mode() == ReduceMode::kAllReduce) {
      f.reduced = send;
      f.target = upcast ? grads : at::Tensor();
      f.work = comm->all_reduce_sum(send);
      return;
    }
    const auto [lo, hi] = layout.shard_range(b, k, comm->rank());
    f.reduced = send.narrow(0, lo - bucket.begin, hi - lo);
    f.target = upcast ? grads.narrow(0, lo - bucket.begin, hi - lo) : at::Tensor();
    f.work = comm->reduce_scatter_sum(send, f.reduced);
  }

  bool bucket_complete(size_t position) const {
    const auto [b, k] = layout.bucket_order[position];
    return waiting[b][k] == 0;
  }

  void on_grad_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    adopt_grad(i);
    finished = false;
    if (!sync) return;
    TORCH_CHECK(!ready[i], "[mixprec::distributed::GradReducer] the gradient of '",
                layout.params[i].fqn,
                "' arrived twice before finish(): call finish() after each backward, or "
                "accumulate micro-batches inside a NoSyncGuard");
    ready[i] = 1;
    const auto [b, k] = bucket_of[i];
    --waiting[b][k];
    if (!options.overlap()) return;
    while (next < layout.bucket_order.size() && bucket_complete(next)) {
      start(next++);
      ++started_in_backward;
    }
  }
};

namespace {

struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  ReadyHook(std::weak_ptr<GradReducer::State> state, size_t index)
      : state(std::move(state)), index(index) {}
  void operator()(const torch::autograd::Variable& /*param*/) override {
    if (auto s = state.lock()) s->on_grad_ready(index);
  }
  std::weak_ptr<GradReducer::State> state;
  size_t index;
};

}  // namespace

GradReducer::GradReducer(std::shared_ptr<Communicator> comm, torch::nn::Module& model,
                         GradReducerOptions options)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(comm, "[mixprec::distributed::GradReducer] the communicator is null");
  // First, so that ranks holding different models all fail here with the same message.
  check_same_model(*comm, model);

  State& s = *state_;
  s.comm = std::move(comm);
  s.options = options;
  std::vector<LayoutParam> entries;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.defined() || !p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    const auto dtype = p.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "[mixprec::distributed::GradReducer] '", item.key(), "' is a trainable ", dtype,
                " parameter; gradients are reduced for Float, BFloat16 and Half");
    TORCH_CHECK(p.layout() == at::kStrided && p.is_contiguous(),
                "[mixprec::distributed::GradReducer] '", item.key(),
                "' must be dense and contiguous");
    TORCH_CHECK(s.params.empty() || p.device() == s.params.front().device(),
                "[mixprec::distributed::GradReducer] '", item.key(), "' is on ", p.device(), ", '",
                entries.front().fqn, "' on ", s.params.front().device(),
                "; one reducer serves one device");
    TORCH_CHECK(torch::autograd::impl::post_acc_grad_hooks(p) == nullptr,
                "[mixprec::distributed::GradReducer] '", item.key(),
                "' already has a post-accumulate-grad hook (is another GradReducer attached?)");
    entries.push_back(LayoutParam{item.key(), p.sizes().vec(), dtype});
    s.params.push_back(p);
  }
  s.layout = make_grad_layout(std::move(entries), s.comm->size(),
                              {options.bucket_numel(), options.shard_alignment()});

  const c10::Device device = s.params.empty() ? c10::Device(at::kCPU) : s.params[0].device();
  s.views.resize(s.params.size());
  s.bucket_of.resize(s.params.size());
  s.waiting.resize(s.layout.buffers.size());
  for (size_t b = 0; b < s.layout.buffers.size(); ++b) {
    const BufferLayout& buf = s.layout.buffers[b];
    s.buffers.push_back(at::zeros({buf.numel}, at::TensorOptions(buf.dtype).device(device)));
    s.waiting[b].resize(buf.buckets.size());
    for (const ParamSpan& span : buf.spans) {
      s.views[span.param] = s.buffers[b]
                                .narrow(0, span.begin, span.end - span.begin)
                                .view(s.layout.params[span.param].shape);
      s.bucket_of[span.param] = {b, span.bucket};
    }
  }
  s.ready.resize(s.params.size());
  s.reset_step();
  s.timing.buckets = static_cast<int64_t>(s.layout.bucket_order.size());
  for (size_t i = 0; i < s.params.size(); ++i) {
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
  TORCH_CHECK(s.next == 0, "[mixprec::distributed::GradReducer::zero_grad] ", s.next,
              " bucket reduction(s) are in flight; call finish() first");
  at::NoGradGuard no_grad;
  for (at::Tensor& buffer : s.buffers) buffer.zero_();
  for (size_t i = 0; i < s.params.size(); ++i) s.adopt_grad(i);
  s.reset_step();
  s.finished = false;
}

void GradReducer::finish() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(s.sync, "[mixprec::distributed::GradReducer::finish] called inside a NoSyncGuard");
  if (s.finished) return;  // already reduced: averaging again would change the gradients
  const auto t0 = std::chrono::steady_clock::now();
  s.timing.launched_during_backward = s.started_in_backward;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (s.ready[i]) continue;
    s.adopt_grad(i);
    s.ready[i] = 1;
    --s.waiting[s.bucket_of[i].first][s.bucket_of[i].second];
  }
  try {
    while (s.next < s.layout.bucket_order.size()) s.start(s.next++);
    at::NoGradGuard no_grad;
    const int n = s.comm->size();
    for (State::InFlight& f : s.in_flight) {
      f.work.wait();
      if (n > 1) f.reduced.div_(n);
      if (f.target.defined()) f.target.copy_(f.reduced);
    }
  } catch (...) {
    // The gradients are unusable now, but the reducer is not stuck: zero_grad() works again.
    s.reset_step();
    throw;
  }
  s.reset_step();
  s.finished = true;
  s.timing.finish_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

GradReducer::NoSyncGuard::NoSyncGuard(GradReducer& reducer) : reducer_(reducer) {
  std::lock_guard<std::mutex> lock(reducer_.state_->mutex);
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
  TORCH_CHECK(index < state_->buffers.size(),
              "[mixprec::distributed::GradReducer::grad_buffer] no buffer ", index);
  return state_->buffers[index];
}
const at::Tensor& GradReducer::param(size_t index) const {
  TORCH_CHECK(index < state_->params.size(),
              "[mixprec::distributed::GradReducer::param] no parameter ", index);
  return state_->params[index];
}
const ReductionTiming& GradReducer::last_timing() const { return state_->timing; }

}  // namespace mixprec::distributed
