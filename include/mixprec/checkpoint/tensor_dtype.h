// Mapping between LibTorch dtypes and the checkpoint format's dtype names.
#pragma once

#include "mixprec/checkpoint/format/dtype.h"

#include <c10/core/ScalarType.h>

namespace mixprec::checkpoint {

// Throws c10::Error naming the dtype if the format has no name for it (complex, quantized…).
Dtype to_checkpoint_dtype(c10::ScalarType type);
c10::ScalarType to_scalar_type(Dtype dtype);

}  // namespace mixprec::checkpoint
