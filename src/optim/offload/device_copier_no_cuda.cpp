// Builds against a CPU-only LibTorch: there is no CUDA engine (and no CUDA tensor to use it).
#include "optim/offload/device_copier.h"

#include <c10/util/Exception.h>

namespace mixprec::optim::detail {

std::unique_ptr<DeviceCopier> make_cuda_copier(c10::Device device) {
  TORCH_CHECK(false, "[mixprec::optim offload] parameters on ", device,
              " but this build of mixprec has no CUDA copy engine: it was compiled against a "
              "LibTorch without CUDA; rebuild against a CUDA LibTorch");
}

}  // namespace mixprec::optim::detail
