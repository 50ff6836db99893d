// Compiled only against a CUDA LibTorch with NCCL (src/distributed/distributed.cmake), with
// USE_C10D_NCCL; elsewhere nccl_unavailable.cpp provides these functions.
#include "distributed/backend_factory.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace mixprec::distributed::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

bool nccl_compiled() { return true; }

}  // namespace mixprec::distributed::detail
