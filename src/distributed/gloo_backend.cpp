// Compiled with USE_C10D_GLOO (src/distributed/distributed.cmake) and without the shared
// precompiled header: the only translation unit that includes ProcessGroupGloo.hpp and, through it,
// Debian's gloo headers. Those are older than the gloo inside the wheel's libtorch_cpu, so this
// file only calls functions compiled into the wheel (create_default, the constructor) and hands the
// group out as a c10d::Backend, whose virtual interface is all the rest of mixprec uses.
#include "distributed/backend_factory.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace mixprec::distributed::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace mixprec::distributed::detail
