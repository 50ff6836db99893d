// Builds against a CPU-only LibTorch: NCCL groups are refused with a clear error.
#include "distributed/backend_factory.h"

#include <c10/util/Exception.h>

namespace mixprec::distributed::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, std::chrono::milliseconds) {
  TORCH_CHECK(
      false,
      "[mixprec::distributed::init] this build of mixprec has no NCCL backend: it was compiled "
      "against a LibTorch without CUDA; use BackendKind::kGloo or rebuild against a "
      "CUDA LibTorch");
}

bool nccl_compiled() { return false; }

}  // namespace mixprec::distributed::detail
