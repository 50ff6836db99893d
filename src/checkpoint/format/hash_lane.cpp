#include "hash_lane.h"

#include <utility>

namespace mixprec::checkpoint::detail {

HashLane::HashLane(bool threaded) {
  if (threaded) thread_ = std::thread([this] { loop(); });
}

HashLane::~HashLane() {
  if (!thread_.joinable()) return;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(lock);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void HashLane::wait_idle(std::unique_lock<std::mutex>& lock) {
  changed_.wait(lock, [this] { return !job_; });
}

void HashLane::run(std::function<void()> job) {
  if (!thread_.joinable()) {
    job();
    return;
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_idle(lock);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    job_ = std::move(job);
  }
  changed_.notify_all();
}

void HashLane::drain() {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  wait_idle(lock);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void HashLane::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [this] { return job_ || stopping_; });
    if (!job_) return;  // stopping, nothing left
    lock.unlock();
    try {
      job_();
    } catch (...) {
      lock.lock();
      error_ = std::current_exception();
      lock.unlock();
    }
    lock.lock();
    job_ = nullptr;
    changed_.notify_all();
  }
}

}  // namespace mixprec::checkpoint::detail
