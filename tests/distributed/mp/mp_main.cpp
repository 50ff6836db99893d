// distributed_mp_tests: GoogleTest cases that every rank runs together. Started by ctest through
// `torchrun --standalone --nproc-per-node N --no-python distributed_mp_tests --gtest_filter=...`;
// with a bad launcher environment it prints the error and exits 1
// (tests/distributed/distributed.cmake checks that message).
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/init.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace {

// Ranks other than 0 print only their failures, each line tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::cerr << "[rank " << rank_ << "] " << (result.file_name() ? result.file_name() : "?") << ":"
              << result.line_number() << ": " << result.summary() << std::endl;
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    mixprec::distributed::InitOptions options;
    options.timeout = std::chrono::seconds(60);
    // The GPU check (scripts/gpu-check.sh) runs these cases on NCCL and CUDA tensors.
    const char* backend = std::getenv("MIXPREC_TEST_BACKEND");
    if (backend != nullptr && std::string(backend) == "nccl")
      options.backend = mixprec::distributed::BackendKind::kNccl;
    mixprec::testing::set_world(mixprec::distributed::init_from_env(options));
  } catch (const c10::Error& e) {
    std::cerr << "distributed_mp_tests: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  const int rank = mixprec::testing::world().rank();
  if (rank != 0) {
    // One rank's progress lines are enough; failures still print on every rank.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int status = RUN_ALL_TESTS();
  if (status != 0)
    std::cerr << "distributed_mp_tests: rank " << rank << " had failures" << std::endl;
  try {
    mixprec::testing::world().barrier();
  } catch (const c10::Error&) {
    // A test broke the group (a rank was killed on purpose): the status already says so.
    if (status == 0) throw;
  }
  // Before exit, not in static destruction: by then CUDA may be unloaded, and NCCL's group
  // aborts the process if it is destroyed after that.
  mixprec::testing::set_world(nullptr);
  return status;
}
