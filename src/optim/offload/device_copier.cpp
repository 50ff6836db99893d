// The copy-thread engine and the choice of engine per device.
#include "optim/offload/device_copier.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace mixprec::optim::detail {
namespace {

// One worker thread runs the batches in the order they were issued, so a download issued
// after an upload (the `after` ticket) starts only once that upload is done. Host-to-host
// copies are a plain memcpy: the worker must not start OpenMP teams of its own beside the
// kernels' (ATen's copy_ would); other devices go through copy_.
class ThreadCopier final : public DeviceCopier {
 public:
  explicit ThreadCopier(c10::Device device) : device_(device) {
    worker_ = std::thread([this] { run(); });
  }
  ~ThreadCopier() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    queued_.notify_all();
    worker_.join();
  }

  c10::Device device() const override { return device_; }
  at::Tensor staging(int64_t bytes) override { return at::empty({bytes}, at::kByte); }

  void begin() override {
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return done_ == issued_; });
    error_ = nullptr;  // a failed step's error was reported by its wait()
  }
  Ticket download(std::vector<CopySpan> copies, Ticket after) override {
    TORCH_INTERNAL_ASSERT(after < issued_, "a download may only wait for an earlier batch");
    return enqueue(std::move(copies));
  }
  Ticket upload(std::vector<CopySpan> copies) override { return enqueue(std::move(copies)); }
  void wait(Ticket ticket) override {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(ticket >= 0 && ticket < issued_);
    finished_.wait(lock, [&] { return done_ > ticket; });
    if (error_) std::rethrow_exception(error_);
  }
  void end() override {}
  double take_busy_seconds() override {
    std::lock_guard<std::mutex> lock(mutex_);
    const double busy = busy_seconds_;
    busy_seconds_ = 0.0;
    return busy;
  }

 private:
  Ticket enqueue(std::vector<CopySpan> copies) {
    for (const CopySpan& c : copies) {
      TORCH_INTERNAL_ASSERT(c.dst.is_contiguous() && c.src.is_contiguous() &&
                            c.dst.nbytes() == c.src.nbytes() &&
                            c.dst.scalar_type() == c.src.scalar_type());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(copies));
    queued_.notify_one();
    return issued_++;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      queued_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      std::vector<CopySpan> job = std::move(jobs_.front());
      jobs_.pop_front();
      const bool skip = error_ != nullptr;  // after a failure, later batches are not run
      lock.unlock();
      const auto start = std::chrono::steady_clock::now();
      std::exception_ptr error;
      if (!skip) {
        try {
          for (const CopySpan& c : job) copy(c);
        } catch (...) {
          error = std::current_exception();
        }
      }
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      job.clear();  // release the tensors before reporting the batch done
      lock.lock();
      busy_seconds_ += took.count();
      if (error && !error_) error_ = error;
      ++done_;
      finished_.notify_all();
    }
  }

  static void copy(const CopySpan& c) {
    if (c.dst.is_cpu() && c.src.is_cpu()) {
      if (c.dst.nbytes() > 0) std::memcpy(c.dst.data_ptr(), c.src.const_data_ptr(), c.dst.nbytes());
    } else {
      c.dst.copy_(c.src);
    }
  }

  const c10::Device device_;
  std::mutex mutex_;
  std::condition_variable queued_, finished_;
  std::deque<std::vector<CopySpan>> jobs_;
  Ticket issued_ = 0;  // batches issued; tickets are 0, 1, 2, ...
  Ticket done_ = 0;    // batches finished (in order)
  std::exception_ptr error_;
  double busy_seconds_ = 0.0;
  bool stop_ = false;
  std::thread worker_;  // last: started once everything above exists
};

}  // namespace

std::unique_ptr<DeviceCopier> make_device_copier(c10::Device device) {
  if (device.is_cuda()) return make_cuda_copier(device);
  return std::make_unique<ThreadCopier>(device);
}

}  // namespace mixprec::optim::detail
