#include "mixprec/distributed/communicator.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

namespace mixprec::distributed {

const char* to_string(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce:
      return "all-reduce";
    case Collective::kReduceScatter:
      return "reduce-scatter";
    case Collective::kAllGather:
      return "all-gather";
    case Collective::kBroadcast:
      return "broadcast";
  }
  return "?";
}

namespace {

std::string describe(const at::Tensor& t) {
  return std::to_string(t.numel()) + " x " + std::string(c10::toString(t.scalar_type()));
}

// The largest all-reduce sum two Gloo ranks run as an exchange (see Communicator::all_reduce).
constexpr size_t kExchangedAllReduceMaxBytes = size_t{64} << 10;

void check_tensor(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.defined(), "[mixprec::distributed::", op, "] ", arg, " is undefined");
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 ||
                  dtype == at::kHalf || dtype == at::kLong || dtype == at::kByte,
              "[mixprec::distributed::", op, "] ", arg, " has dtype ", dtype,
              "; supported: Float, Double, BFloat16, Half, Long, Byte");
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), "[mixprec::distributed::", op, "] ",
              arg, " must be dense and contiguous");
}

std::string what_of(const c10::Error& e) { return e.what_without_backtrace(); }

// True when `part` lies apart from `whole`, false when it is exactly chunk `rank` of it (the
// in-place form of a reduce-scatter's output or an all-gather's input); throws otherwise.
bool lies_apart(const at::Tensor& whole, const at::Tensor& part, int rank, const char* op,
                const char* part_name, const char* whole_name) {
  const char* whole_begin = static_cast<const char*>(whole.const_data_ptr());
  const char* part_begin = static_cast<const char*>(part.const_data_ptr());
  const bool apart =
      part_begin + part.nbytes() <= whole_begin || whole_begin + whole.nbytes() <= part_begin;
  TORCH_CHECK(apart || part_begin == whole_begin + rank * part.nbytes(),
              "[mixprec::distributed::", op, "] ", part_name, " overlaps ", whole_name,
              " other than as this rank's chunk of it");
  return apart;
}

// What wait() does after a collective that ran on `ran_on`: where that is a device copy of
// `host`, copy the result back (wait() has ordered the current stream after the backend's).
// Nothing when the collective ran on the tensor itself.
std::function<void()> copy_back(const at::Tensor& host, const at::Tensor& ran_on) {
  if (ran_on.is_same(host)) return nullptr;
  return [host, ran_on] { host.copy_(ran_on); };
}

// Children of `rank` in Gloo's binomial broadcast tree rooted at `root` (gloo/broadcast.cc):
// how many times this rank sends the buffer.
int binomial_tree_sends(int rank, int root, int size) {
  const int vrank = (rank - root + size) % size;
  int dim = 0;
  while ((1 << dim) < size) ++dim;
  int mask = (1 << dim) - 1, sends = 0;
  for (int i = 0; i < dim; ++i) {
    mask ^= 1 << i;
    if ((vrank & mask) != 0) continue;
    const int vpeer = vrank ^ (1 << i);
    if (vpeer < size && (vrank & (1 << i)) == 0) ++sends;
  }
  return sends;
}

}  // namespace

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what,
                                     Communicator* comm)
    : what_(std::move(what)), comm_(comm) {
  works_.push_back(std::move(work));
}

PendingCollective::PendingCollective(std::vector<c10::intrusive_ptr<c10d::Work>> works,
                                     std::string what, Communicator* comm,
                                     std::function<void()> then)
    : works_(std::move(works)), what_(std::move(what)), comm_(comm), then_(std::move(then)) {}

PendingCollective::PendingCollective(PendingCollective&& other) noexcept
    : works_(std::exchange(other.works_, {})),
      what_(std::move(other.what_)),
      comm_(other.comm_),
      then_(std::exchange(other.then_, nullptr)) {}

PendingCollective& PendingCollective::operator=(PendingCollective&& other) noexcept {
  if (this != &other) {
    abandon();
    works_ = std::exchange(other.works_, {});
    what_ = std::move(other.what_);
    comm_ = other.comm_;
    then_ = std::exchange(other.then_, nullptr);
  }
  return *this;
}

PendingCollective::~PendingCollective() { abandon(); }

void PendingCollective::abandon() noexcept {
  // A point-to-point transfer is cancelled when its work is destroyed, and the peer would wait
  // for it in vain: the communicator keeps the works until they finish.
  if (!works_.empty() && comm_ != nullptr) comm_->keep_until_done(std::exchange(works_, {}));
  works_.clear();
  then_ = nullptr;
}

void PendingCollective::wait() {
  if (works_.empty()) return;
  auto works = std::exchange(works_, {});
  // One deadline for all the works of this collective.
  const auto deadline = std::chrono::steady_clock::now() + comm_->timeout_;
  std::string error;
  size_t done = 0;
  try {
    for (; done < works.size(); ++done) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      works[done]->wait(std::max(left, std::chrono::milliseconds(1)));
    }
    if (then_) std::exchange(then_, nullptr)();
    return;
  } catch (const c10::Error& e) {
    error = what_of(e);
  } catch (const std::exception& e) {
    error = e.what();
  }
  then_ = nullptr;
  works.erase(works.begin(),
              works.begin() + static_cast<std::ptrdiff_t>(std::min(done + 1, works.size())));
  if (!works.empty()) comm_->keep_until_done(std::move(works));
  const std::string message = c10::str(
      what_, " failed on rank ", comm_->rank_, " of ", comm_->size_, " (timeout ",
      comm_->timeout_.count(),
      " ms; a rank that is missing or calls collectives in another order ends here): ", error);
  comm_->fail(message);
  TORCH_CHECK(false, "[mixprec::distributed] ", message);
}

void Communicator::keep_until_done(std::vector<c10::intrusive_ptr<c10d::Work>> works) noexcept {
  try {
    std::lock_guard<std::mutex> lock(exchange_mutex_);
    std::erase_if(unwaited_, [](const auto& work) { return work->isCompleted(); });
    for (auto& work : works) unwaited_.push_back(std::move(work));
  } catch (...) {
  }
}

void Communicator::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (failed_) return;
    failure_ = reason;
    failed_ = true;
  }
  // In-flight collectives may still write into their tensors; where the backend can, it stops
  // them. (Gloo cannot: its works keep their tensors alive, and nothing reuses them.)
  try {
    backend_->abort();
  } catch (...) {
  }
}

bool Communicator::failed() const { return failed_; }

void Communicator::check_usable(const char* who) const {
  if (!failed_) return;
  std::lock_guard<std::mutex> lock(failure_mutex_);
  TORCH_CHECK(false, "[", who,
              "] the process group is unusable: an earlier collective failed, and ranks may "
              "hold partial results (",
              failure_, "). Create a new group (and the objects using it) to go on.");
}

Communicator::Communicator(c10::intrusive_ptr<c10d::Backend> backend,
                           std::chrono::milliseconds timeout)
    : backend_(std::move(backend)), timeout_(timeout) {
  TORCH_CHECK(backend_, "[mixprec::distributed::Communicator] the backend is null");
  TORCH_CHECK(timeout_.count() > 0,
              "[mixprec::distributed::Communicator] timeout must be > 0 ms, got ",
              timeout_.count());
  rank_ = backend_->getRank();
  size_ = backend_->getSize();
  TORCH_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_,
              "[mixprec::distributed::Communicator] backend reports rank ", rank_, " of ", size_);
  gloo_ = backend_->getBackendName() == "gloo";
  device_memory_only_ = backend_->getBackendName() == "nccl";
}

std::optional<c10::Device> Communicator::staging_device(const at::Tensor& t) const {
  if (!device_memory_only_ || !t.is_cpu()) return std::nullopt;
  // The group's GPU (init binds it), else the current one, asked through c10's registry:
  // this file compiles without CUDA.
  if (const std::optional<at::Device> bound = backend_->getBoundDeviceId()) return *bound;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
}

bool Communicator::exchanges_pairwise() const { return gloo_ && size_ == 2; }
bool Communicator::has_native_reduce_scatter() const { return !gloo_ || exchanges_pairwise(); }

Communicator::~Communicator() = default;

std::string Communicator::backend_name() const { return backend_->getBackendName(); }

void Communicator::count(Collective collective, int64_t payload_bytes, double bytes_sent) {
  Counter& c = traffic_[static_cast<size_t>(collective)];
  c.calls += 1;
  c.payload += payload_bytes;
  c.sent += static_cast<int64_t>(bytes_sent + 0.5);
}

TrafficStats Communicator::traffic(Collective collective) const {
  const Counter& c = traffic_[static_cast<size_t>(collective)];
  return {c.calls.load(), c.payload.load(), c.sent.load()};
}

void Communicator::reset_traffic() {
  for (Counter& c : traffic_) {
    c.calls = 0;
    c.payload = 0;
    c.sent = 0;
  }
}

PendingCollective Communicator::all_reduce(const at::Tensor& tensor, int op, const char* name) {
  check_usable("mixprec::distributed::Communicator");
  check_tensor(tensor, name, "tensor");
  if (tensor.numel() == 0) return {};
  const double n = size_, bytes = static_cast<double>(tensor.nbytes());
  count(Collective::kAllReduce, static_cast<int64_t>(tensor.nbytes()), bytes * 2 * (n - 1) / n);
  if (op == c10d::ReduceOp::SUM && exchanges_pairwise() && tensor.is_cpu() &&
      tensor.nbytes() <= kExchangedAllReduceMaxBytes) {
    // Two ranks: one round trip, each sending its tensor whole and adding the peer's in wait().
    // As many bytes as Gloo's ring, without its chain of dependent steps (its all-reduce of a
    // hundred floats takes 1.3-2 ms on two loopback ranks, an exchange 0.2), and the same sum
    // on both ranks bit for bit: a + b is b + a. Larger sums (gradient buckets), where
    // bandwidth and not latency sets the time, stay on the ring: Gloo's threads add there,
    // during backward, where an exchange adds in wait(), and its temporaries are chunks, not a
    // copy of the tensor.
    const at::Tensor flat = tensor.view({-1});
    return exchange_and_add(flat, flat, flat,
                            std::string(name) + " (two-rank exchange) of " + describe(tensor));
  }
  const std::optional<c10::Device> device = staging_device(tensor);
  const at::Tensor on = device ? tensor.to(*device) : tensor;
  std::vector<at::Tensor> tensors{on};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
  options.timeout = timeout_;
  return {{backend_->allreduce(tensors, options)},
          std::string(name) + " of " + describe(tensor),
          this,
          copy_back(tensor, on)};
}

PendingCollective Communicator::all_reduce_sum(const at::Tensor& tensor) {
  return all_reduce(tensor, c10d::ReduceOp::SUM, "all_reduce_sum");
}
PendingCollective Communicator::all_reduce_max(const at::Tensor& tensor) {
  return all_reduce(tensor, c10d::ReduceOp::MAX, "all_reduce_max");
}
PendingCollective Communicator::all_reduce_min(const at::Tensor& tensor) {
  return all_reduce(tensor, c10d::ReduceOp::MIN, "all_reduce_min");
}

PendingCollective Communicator::reduce_scatter_sum(const at::Tensor& input,
                                                   const at::Tensor& output) {
  check_usable("mixprec::distributed::Communicator");
  check_tensor(input, "reduce_scatter_sum", "input");
  check_tensor(output, "reduce_scatter_sum", "output");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(),
              "[mixprec::distributed::reduce_scatter_sum] input is ", input.scalar_type(),
              ", output is ", output.scalar_type());
  TORCH_CHECK(input.device() == output.device(),
              "[mixprec::distributed::reduce_scatter_sum] input is on ", input.device(),
              ", output on ", output.device());
  TORCH_CHECK(input.numel() == output.numel() * size_,
              "[mixprec::distributed::reduce_scatter_sum] input has ", input.numel(),
              " elements; it must have world size (", size_, ") x output (", output.numel(),
              ") elements");
  (void)lies_apart(input, output, rank_, "reduce_scatter_sum", "output", "input");
  if (input.numel() == 0) return {};
  if (exchanges_pairwise() && input.is_cpu()) return exchange_halves(input, output);
  const double n = size_, bytes = static_cast<double>(input.nbytes());
  count(Collective::kReduceScatter, static_cast<int64_t>(input.nbytes()),
        bytes * (gloo_ ? 2.0 : 1.0) * (n - 1) / n);
  // The backend sees 1-D tensors, so "chunk `rank` of dimension 0" is the flat range above.
  at::Tensor in = input.view({-1});
  at::Tensor out = output.view({-1});
  const std::optional<c10::Device> device = staging_device(in);
  at::Tensor from = device ? in.to(*device) : in;
  at::Tensor to = device ? at::empty_like(out, out.options().device(*device)) : out;
  c10d::ReduceScatterOptions options;
  options.timeout = timeout_;
  return {{backend_->_reduce_scatter_base(to, from, options)},
          "reduce_scatter_sum of " + describe(input),
          this,
          copy_back(out, to)};
}

int Communicator::next_exchange_tag() {
  // Every rank makes its exchanges in one order, so the n-th exchange has the same tag on all.
  constexpr uint32_t kTags = std::numeric_limits<int>::max();
  return static_cast<int>(exchange_count_.fetch_add(1) % kTags) + 1;
}

PendingCollective Communicator::exchange(std::vector<Transfer> transfers, std::string what,
                                         std::function<void()> then) {
  const int tag = next_exchange_tag();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  try {
    for (Transfer& t : transfers) {
      std::vector<at::Tensor> into{std::move(t.receive)};
      std::vector<at::Tensor> from{std::move(t.send)};
      works.push_back(backend_->recv(into, t.peer, tag));
      works.push_back(backend_->send(from, t.peer, tag));
    }
  } catch (const std::exception& e) {
    // This rank's tag count has moved on and a receive may be posted: the ranks no longer
    // agree, so the group is done.
    if (!works.empty()) keep_until_done(std::move(works));
    fail(what + " could not start on rank " + std::to_string(rank_) + ": " + e.what());
    throw;
  }
  return {std::move(works), std::move(what), this, std::move(then)};
}

at::Tensor Communicator::take_scratch(const at::Tensor& like) {
  {
    std::lock_guard<std::mutex> lock(exchange_mutex_);
    auto it = std::find_if(free_scratch_.begin(), free_scratch_.end(), [&](const at::Tensor& t) {
      return t.numel() == like.numel() && t.scalar_type() == like.scalar_type() &&
             t.device() == like.device();
    });
    if (it != free_scratch_.end()) {
      at::Tensor found = std::move(*it);
      free_scratch_.erase(it);
      return found;
    }
  }
  return at::empty({like.numel()}, like.options());
}

void Communicator::return_scratch(at::Tensor scratch) {
  std::lock_guard<std::mutex> lock(exchange_mutex_);
  free_scratch_.push_back(std::move(scratch));
}

PendingCollective Communicator::exchange_halves(const at::Tensor& input, const at::Tensor& output) {
  const int peer = 1 - rank_;
  const int64_t half = output.numel();
  count(Collective::kReduceScatter, static_cast<int64_t>(input.nbytes()),
        static_cast<double>(input.nbytes()) / 2);
  const at::Tensor flat = input.view({-1});
  return exchange_and_add(output.view({-1}), flat.narrow(0, rank_ * half, half),
                          flat.narrow(0, peer * half, half),
                          "reduce_scatter_sum (two-rank exchange) of " + describe(input));
}

PendingCollective Communicator::exchange_and_add(at::Tensor out, at::Tensor mine, at::Tensor send,
                                                 std::string what) {
  at::Tensor received = take_scratch(mine);
  return exchange({{1 - rank_, received, std::move(send)}}, std::move(what),
                  [this, out = std::move(out), mine = std::move(mine), received]() mutable {
                    at::add_out(out, mine, received);
                    return_scratch(std::move(received));
                  });
}

PendingCollective Communicator::all_gather(const at::Tensor& input, const at::Tensor& output) {
  check_usable("mixprec::distributed::Communicator");
  check_tensor(input, "all_gather", "input");
  check_tensor(output, "all_gather", "output");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(),
              "[mixprec::distributed::all_gather] input is ", input.scalar_type(), ", output is ",
              output.scalar_type());
  TORCH_CHECK(input.device() == output.device(), "[mixprec::distributed::all_gather] input is on ",
              input.device(), ", output on ", output.device());
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "[mixprec::distributed::all_gather] output has ", output.numel(),
              " elements; it must have world size (", size_, ") x input (", input.numel(),
              ") elements");
  if (input.numel() == 0) return {};
  const bool apart = lies_apart(output, input, rank_, "all_gather", "input", "output");
  const double n = size_, bytes = static_cast<double>(output.nbytes());
  count(Collective::kAllGather, static_cast<int64_t>(output.nbytes()), bytes * (n - 1) / n);
  at::Tensor in = input.view({-1});
  at::Tensor out = output.view({-1});
  if (gloo_ && in.is_cpu()) {
    // Gloo: send this rank's chunk to every other rank and receive theirs in place, all at
    // once: what a ring all-gather sends, without Gloo's copy out or its chain of steps.
    if (apart) out.narrow(0, rank_ * in.numel(), in.numel()).copy_(in);
    std::vector<Transfer> transfers;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_)
        transfers.push_back({peer, out.narrow(0, peer * in.numel(), in.numel()), in});
    }
    return exchange(std::move(transfers), "all_gather (direct exchange) of " + describe(output),
                    nullptr);
  }
  // Host tensors on NCCL: this rank's chunk goes into the device copy of the output, and the
  // gather runs in place there.
  const std::optional<c10::Device> device = staging_device(out);
  at::Tensor to = device ? at::empty_like(out, out.options().device(*device)) : out;
  at::Tensor from = device ? to.narrow(0, rank_ * in.numel(), in.numel()).copy_(in) : in;
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  return {{backend_->_allgather_base(to, from, options)},
          "all_gather of " + describe(output),
          this,
          copy_back(out, to)};
}

PendingCollective Communicator::broadcast(const at::Tensor& tensor, int root) {
  check_usable("mixprec::distributed::Communicator");
  check_tensor(tensor, "broadcast", "tensor");
  TORCH_CHECK(root >= 0 && root < size_, "[mixprec::distributed::broadcast] root ", root,
              " is not a rank of ", size_);
  if (tensor.numel() == 0) return {};
  // A binomial tree on Gloo; other backends' trees or rings send as much in total.
  const double bytes = static_cast<double>(tensor.nbytes());
  count(Collective::kBroadcast, static_cast<int64_t>(tensor.nbytes()),
        bytes * binomial_tree_sends(rank_, root, size_));
  const std::optional<c10::Device> device = staging_device(tensor);
  // Only the root's bytes matter on the way in.
  const at::Tensor on = !device         ? tensor
                        : rank_ == root ? tensor.to(*device)
                                        : at::empty_like(tensor, tensor.options().device(*device));
  std::vector<at::Tensor> tensors{on};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.rootTensor = 0;
  options.timeout = timeout_;
  return {{backend_->broadcast(tensors, options)},
          "broadcast from rank " + std::to_string(root) + " of " + describe(tensor),
          this,
          copy_back(tensor, on)};
}

std::vector<std::string> Communicator::all_gather_strings(const std::string& mine) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({size_}, at::kLong);
  all_gather(length, lengths).wait();
  const auto* all = lengths.const_data_ptr<int64_t>();
  const int64_t longest = *std::max_element(all, all + size_);
  std::vector<std::string> out(size_);
  if (longest == 0) return out;
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.mutable_data_ptr<uint8_t>());
  at::Tensor gathered = at::empty({longest * size_}, at::kByte);
  all_gather(bytes, gathered).wait();
  const auto* data = gathered.const_data_ptr<uint8_t>();
  for (int r = 0; r < size_; ++r) {
    TORCH_CHECK(all[r] >= 0 && all[r] <= longest,
                "[mixprec::distributed::all_gather_strings] rank ", r, " sent length ", all[r]);
    out[r].assign(reinterpret_cast<const char*>(data + r * longest), all[r]);
  }
  return out;
}

void Communicator::barrier() {
  at::Tensor one = at::ones({1}, at::kLong);
  all_reduce_sum(one).wait();
  TORCH_INTERNAL_ASSERT(one.item<int64_t>() == size_, "barrier counted ", one.item<int64_t>(),
                        " ranks of ", size_);
}

}  // namespace mixprec::distributed
