// A second thread for checksums, so that moving bytes through a file and hashing them overlap
// instead of adding up.
//
// A read loop reads slice k, hands its hashing to the lane, and reads slice k + 1 while the
// lane hashes slice k; a write hands a large piece's hashing to the lane and writes it
// meanwhile. The page-cache copy of pread(2) or write(2) is the kernel's work on the calling
// thread, the hash another core's: with a core to spare, the two take as long as the slower
// rather than their sum. One job runs at a time, in the order given.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace mixprec::checkpoint::detail {

class HashLane {
 public:
  // Without a thread (`threaded` false) every job runs inline in run(): for reads too small to
  // repay a thread's start.
  explicit HashLane(bool threaded);
  // Waits for the job in flight; an error it threw is dropped (the caller is unwinding).
  ~HashLane();
  HashLane(const HashLane&) = delete;
  HashLane& operator=(const HashLane&) = delete;

  // Waits for the previous job, then starts `job`. When this returns the previous job is done,
  // so the memory it read may be reused. Rethrows an error of the previous job.
  void run(std::function<void()> job);
  // Waits for the job in flight; rethrows its error.
  void drain();

 private:
  void wait_idle(std::unique_lock<std::mutex>& lock);
  void loop();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void()> job_;  // set while a job waits for or runs on the thread
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace mixprec::checkpoint::detail
