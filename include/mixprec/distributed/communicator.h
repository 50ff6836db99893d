// Communicator: the few collectives mixprec's data parallelism uses, over any c10d::Backend.
//
// mixprec writes no transport. It calls PyTorch's distributed engine through the virtual
// c10d::Backend interface only (ProcessGroupGloo on CPU, ProcessGroupNCCL on GPU, or a backend
// the caller built), so every backend plugs in unchanged. This class adds what the raw
// interface lacks: argument checks that name the collective, a timeout on every wait (a rank
// that never arrives is an error, not a hang), and a count of the bytes handed to each kind
// of collective (the benchmark's traffic figures).
//
// Rules every caller follows (STYLE.md, "Distributed code"): every rank calls the same
// collectives in the same order with the same sizes and dtypes; a decision that changes
// control flow is reduced first.
//
// Tensors: dense, contiguous, on the backend's device; dtypes Float, Double, BFloat16, Half,
// Long and Byte. Throws c10::Error "[mixprec::distributed::<op>] ..." otherwise, before anything is
// sent.
//
// A failed collective is fatal for the group. Once a wait fails (a peer died, a timeout, ranks
// that disagree), a collective may still be running in the backend and writing into the
// tensors it was given, and the ranks no longer agree on what was sent: nothing built on the
// group can recover. The communicator aborts the backend (where it supports that) and every
// later call on it, or on anything using it, throws c10::Error naming the collective that
// failed and why. Make a new group to go on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace c10d {
class Backend;
}  // namespace c10d

namespace mixprec::distributed {

enum class Collective { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
const char* to_string(Collective collective);

// What one rank handed to one kind of collective since the last reset.
struct TrafficStats {
  int64_t calls = 0;
  int64_t payload_bytes = 0;  // bytes of the input tensor (all-gather: of the gathered output)
  // What this rank sends for those calls under the algorithm the backend runs: all-reduce
  // 2(N-1)/N of the payload (ring), all-gather (N-1)/N (ring), reduce-scatter (N-1)/N on a
  // backend with a native one, and on Gloo, whose reduce-scatter is a whole all-reduce plus a
  // copy, 2(N-1)/N; a Gloo broadcast, a binomial tree, sends the payload once to each child
  // this rank has in the tree of that root (0 to ceil(log2 N) times). Counted from the
  // algorithm, not from the sockets.
  int64_t bytes_sent = 0;
};

// A collective in flight. wait() blocks at most the communicator's timeout; it throws
// c10::Error naming the collective, its size and this rank if the backend reports an error or
// the timeout passes. Destroying an unwaited PendingCollective does not cancel the collective.
class Communicator;

class [[nodiscard]] PendingCollective {
 public:
  PendingCollective() = default;  // already complete (nothing was sent)
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what, Communicator* comm);
  PendingCollective(PendingCollective&&) noexcept = default;
  PendingCollective& operator=(PendingCollective&&) noexcept = default;
  // Waits (at most the communicator's timeout); on failure marks the group failed (see the
  // header comment) and throws.
  void wait();
  bool pending() const { return work_ != nullptr; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
  Communicator* comm_ = nullptr;
};

class Communicator {
 public:
  // `backend` must be defined; `timeout` bounds every wait (> 0).
  Communicator(c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::string backend_name() const;
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }

  // In place: `tensor` becomes the element-wise sum (or max/min) over ranks.
  PendingCollective all_reduce_sum(const at::Tensor& tensor);
  PendingCollective all_reduce_max(const at::Tensor& tensor);
  PendingCollective all_reduce_min(const at::Tensor& tensor);
  // output = this rank's chunk of the element-wise sum of every rank's `input`:
  // elements [rank * output.numel(), (rank + 1) * output.numel()) of the 1-D flattening.
  // input.numel() must equal size() * output.numel(), same dtype. `output` may be that chunk
  // of `input` itself (in place).
  PendingCollective reduce_scatter_sum(const at::Tensor& input, const at::Tensor& output);
  // output = the concatenation of every rank's `input` in rank order (1-D flattening).
  // output.numel() must equal size() * input.numel(), same dtype; `input` is either apart
  // from `output` or exactly this rank's chunk of it (in place).
  PendingCollective all_gather(const at::Tensor& input, const at::Tensor& output);
  // In place: every rank's `tensor` becomes rank `root`'s.
  PendingCollective broadcast(const at::Tensor& tensor, int root);
  // True when the backend's reduce-scatter sends less than an all-reduce of the same tensor
  // (NCCL's does; Gloo's is an all-reduce plus a copy, so an in-place all-reduce is cheaper).
  bool has_native_reduce_scatter() const;
  // True when the backend's all-gather runs in place without a staging copy (NCCL). Gloo's
  // gathers into a new tensor and copies out; broadcasts from each owner are in place there.
  bool has_native_all_gather() const;

  // Synchronous helpers built on the above.
  // Every rank's string, in rank order (lengths all-gathered as int64, then the bytes).
  std::vector<std::string> all_gather_strings(const std::string& mine);
  // Returns when every rank has called it (an all-reduce of one int64).
  void barrier();

  TrafficStats traffic(Collective collective) const;
  void reset_traffic();

  // The group is unusable after a failed collective (see the header comment): marks it,
  // aborts the backend, and records why. The first reason is kept.
  void fail(const std::string& reason);
  bool failed() const;
  // Throws c10::Error naming `who` and the failure if the group failed; otherwise nothing.
  void check_usable(const char* who) const;

 private:
  friend class PendingCollective;
  PendingCollective all_reduce(const at::Tensor& tensor, int op, const char* name);
  void count(Collective collective, int64_t payload_bytes, double bytes_sent);

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::chrono::milliseconds timeout_;
  int rank_, size_;
  bool gloo_ = false;
  struct Counter {
    std::atomic<int64_t> calls{0}, payload{0}, sent{0};
  };
  std::array<Counter, 4> traffic_;
  std::atomic<bool> failed_{false};
  mutable std::mutex failure_mutex_;
  std::string failure_;  // the first failure's message
};

}  // namespace mixprec::distributed
