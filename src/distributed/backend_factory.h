// Private: the one place that names concrete c10d backends. Each function lives in its own
// translation unit, compiled with that backend's definitions (USE_C10D_GLOO, USE_C10D_NCCL)
// and nothing else, so their headers never reach the rest of the library.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace mixprec::distributed::detail {

// ProcessGroupGloo built through ProcessGroupGloo::Options::create_default(timeout): the only
// construction path that does not depend on the (older) Debian gloo headers' class layouts.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

// ProcessGroupNCCL; throws c10::Error in builds without a CUDA LibTorch (nccl_unavailable.cpp).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);
bool nccl_compiled();

}  // namespace mixprec::distributed::detail
