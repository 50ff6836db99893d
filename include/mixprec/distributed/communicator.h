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
// control flow is reduced first. A communicator serves one thread at a time: collectives issued
// from two threads interleave in a different order on each rank and mismatch. Work that runs
// beside training — an async checkpoint save's background half — therefore gets a group of
// its own (init.h: InitOptions::group_name), never the one a GradReducer uses.
//
// Tensors: dense, contiguous, on the backend's device; dtypes Float, Double, BFloat16, Half,
// Long and Byte. Throws c10::Error "[mixprec::distributed::<op>] ..." otherwise, before anything is
// sent. Input and output of one collective share a device. One exception to "the backend's
// device": NCCL moves device memory only, so a CPU tensor given to a group on NCCL travels
// through a copy on the group's GPU (init_from_env binds LOCAL_RANK's), and wait() copies the
// result back. That serves the library's small agreements (gradient norms, bucket order,
// strings); large tensors belong on the device.
//
// A failed collective is fatal for the group. Once a wait fails (a peer died, a timeout, ranks
// that disagree), a collective may still be running in the backend and writing into the
// tensors it was given, and the ranks no longer agree on what was sent: nothing built on the
// group can recover. The communicator aborts the backend (where it supports that) and every
// later call on it, or on anything using it, throws c10::Error naming the collective that
// failed and why. Make a new group to go on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
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
  // backend with a native one and in Gloo's two-rank exchange, and on Gloo with more ranks,
  // whose reduce-scatter is a whole all-reduce plus a copy, 2(N-1)/N; a Gloo broadcast, a binomial
  // tree, sends the payload once to each child this rank has in the tree of that root (0 to
  // ceil(log2 N) times). Counted from the algorithm, not from the sockets.
  int64_t bytes_sent = 0;
};

// A collective in flight. wait() blocks at most the communicator's timeout; it throws
// c10::Error naming the collective, its size and this rank if the backend reports an error or
// the timeout passes. Destroying an unwaited PendingCollective does not cancel the transfers
// (the communicator keeps them until they finish), but what only wait() does is not done: a
// two-rank exchange's sum (reduce_scatter_sum, and all_reduce_sum up to 64 KiB, on Gloo) leaves
// the output as it was, and so does any collective of CPU tensors on NCCL (the result stays in
// its device copy).
class Communicator;

class [[nodiscard]] PendingCollective {
 public:
  PendingCollective() = default;  // already complete (nothing was sent)
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::string what, Communicator* comm);
  // Several works that make one collective, and what completes it once they are all done (the
  // local sum of a two-rank exchange); `then` runs in wait().
  PendingCollective(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::string what,
                    Communicator* comm, std::function<void()> then);
  PendingCollective(PendingCollective&& other) noexcept;
  PendingCollective& operator=(PendingCollective&& other) noexcept;
  ~PendingCollective();
  // Waits (at most the communicator's timeout); on failure marks the group failed (see the
  // header comment) and throws.
  void wait();
  bool pending() const { return !works_.empty(); }

 private:
  void abandon() noexcept;  // hands unwaited works to the communicator
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::string what_;
  Communicator* comm_ = nullptr;
  std::function<void()> then_;
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

  // In place: `tensor` becomes the element-wise sum (or max/min) over ranks. On Gloo with two
  // ranks a sum of a CPU tensor up to 64 KiB is an exchange: each rank sends its tensor and
  // adds the one it receives in wait(); the bytes of Gloo's ring in one round trip, the same
  // sum on both ranks bit for bit (a + b is b + a).
  PendingCollective all_reduce_sum(const at::Tensor& tensor);
  PendingCollective all_reduce_max(const at::Tensor& tensor);
  PendingCollective all_reduce_min(const at::Tensor& tensor);
  // output = this rank's chunk of the element-wise sum of every rank's `input`:
  // elements [rank * output.numel(), (rank + 1) * output.numel()) of the 1-D flattening.
  // input.numel() must equal size() * output.numel(), same dtype. `output` may be that chunk
  // of `input` itself (in place). The other chunks of `input` are left as they were, except on
  // a backend without a native reduce-scatter (then they hold the sum too). On Gloo with two
  // ranks (CPU tensors) it is an exchange: each rank sends the other's chunk (point to point)
  // and adds the chunk it receives to its own in wait(): half the bytes of an all-reduce, and
  // the same sum bit for bit (a + b is b + a). Point-to-point tags are counted per
  // Communicator: wrap a backend in one Communicator only.
  PendingCollective reduce_scatter_sum(const at::Tensor& input, const at::Tensor& output);
  // output = the concatenation of every rank's `input` in rank order (1-D flattening).
  // output.numel() must equal size() * input.numel(), same dtype; `input` is either apart
  // from `output` or exactly this rank's chunk of it (in place). In place on every backend:
  // NCCL's own (of device tensors; host tensors go through a device copy, see the top of
  // this file), and on Gloo (CPU tensors) a direct exchange: each rank sends its chunk to
  // every other rank and receives theirs in place, all posted at once (Gloo's own gathers
  // into a new tensor and copies out).
  PendingCollective all_gather(const at::Tensor& input, const at::Tensor& output);
  // In place: every rank's `tensor` becomes rank `root`'s.
  PendingCollective broadcast(const at::Tensor& tensor, int root);
  // True when reduce_scatter_sum sends less than an all-reduce of the same tensor: NCCL's; on
  // Gloo the two-rank exchange above. (Gloo's own reduce-scatter is an all-reduce plus a copy,
  // so with more ranks an in-place all-reduce is cheaper; an exchange among more ranks would
  // sum in another order than Gloo's all-reduce, and plain data parallelism would no longer
  // match ZeRO-1 bit for bit.)
  bool has_native_reduce_scatter() const;

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
  // Gloo with two ranks: all-reduce sums and reduce-scatters of CPU tensors are exchanges.
  bool exchanges_pairwise() const;
  // Point to point on Gloo: for each transfer, receive into `receive` from `peer` while
  // sending it `send`, one tag for the whole exchange; `then` completes the collective in
  // wait().
  struct Transfer {
    int peer;
    at::Tensor receive, send;
  };
  PendingCollective exchange(std::vector<Transfer> transfers, std::string what,
                             std::function<void()> then);
  PendingCollective exchange_halves(const at::Tensor& input, const at::Tensor& output);
  // Gloo, two ranks: sends `send` to the other rank and receives as many elements into a
  // pooled buffer; wait() sets out = mine + received (the sums of both two-rank exchanges).
  PendingCollective exchange_and_add(at::Tensor out, at::Tensor mine, at::Tensor send,
                                     std::string what);
  // A receive buffer shaped as `like` (1-D), reused from the pool when one is free: a steady
  // state's exchanges allocate nothing. Given back by the exchange's completion.
  at::Tensor take_scratch(const at::Tensor& like);
  void return_scratch(at::Tensor scratch);
  int next_exchange_tag();
  void keep_until_done(std::vector<c10::intrusive_ptr<c10d::Work>> works) noexcept;
  void count(Collective collective, int64_t payload_bytes, double bytes_sent);
  // For a CPU tensor on a backend that moves device memory only (NCCL): the GPU its copy goes
  // to (the group's bound device, else the current one). Otherwise none: the tensor goes to
  // the backend as it is.
  std::optional<c10::Device> staging_device(const at::Tensor& t) const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::chrono::milliseconds timeout_;
  int rank_, size_;
  bool gloo_ = false;
  bool device_memory_only_ = false;  // NCCL
  struct Counter {
    std::atomic<int64_t> calls{0}, payload{0}, sent{0};
  };
  std::array<Counter, 4> traffic_;
  std::atomic<bool> failed_{false};
  mutable std::mutex failure_mutex_;
  std::string failure_;  // the first failure's message
  // The two-rank exchanges: receive buffers, kept for the next exchange of that size and dtype
  // (a steady-state step allocates nothing), and the count of exchanges, whose tag pairs each
  // send with its receive (every rank calls collectives in one order, so the counts agree).
  // Those buffers hold half of every bucket in flight at once: 2 bytes per parameter when
  // BF16 gradients are summed in FP32. Works whose PendingCollective was dropped unwaited are
  // kept here until they finish.
  std::mutex exchange_mutex_;
  std::vector<at::Tensor> free_scratch_;
  std::vector<c10::intrusive_ptr<c10d::Work>> unwaited_;
  std::atomic<uint32_t> exchange_count_{0};
};

}  // namespace mixprec::distributed
