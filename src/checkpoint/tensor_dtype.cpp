#include "mixprec/checkpoint/tensor_dtype.h"

#include <c10/util/Exception.h>

namespace mixprec::checkpoint {

Dtype to_checkpoint_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::kDouble:
      return Dtype::F64;
    case c10::kFloat:
      return Dtype::F32;
    case c10::kHalf:
      return Dtype::F16;
    case c10::kBFloat16:
      return Dtype::BF16;
    case c10::kFloat8_e4m3fn:
      return Dtype::F8_E4M3;
    case c10::kFloat8_e5m2:
      return Dtype::F8_E5M2;
    case c10::kLong:
      return Dtype::I64;
    case c10::kInt:
      return Dtype::I32;
    case c10::kShort:
      return Dtype::I16;
    case c10::kChar:
      return Dtype::I8;
    case c10::kByte:
      return Dtype::U8;
    case c10::kBool:
      return Dtype::BOOL;
    default:
      break;
  }
  TORCH_CHECK(false, "[mixprec::checkpoint] dtype ", type, " cannot be stored in a checkpoint");
}

c10::ScalarType to_scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::F64:
      return c10::kDouble;
    case Dtype::F32:
      return c10::kFloat;
    case Dtype::F16:
      return c10::kHalf;
    case Dtype::BF16:
      return c10::kBFloat16;
    case Dtype::F8_E4M3:
      return c10::kFloat8_e4m3fn;
    case Dtype::F8_E5M2:
      return c10::kFloat8_e5m2;
    case Dtype::I64:
      return c10::kLong;
    case Dtype::I32:
      return c10::kInt;
    case Dtype::I16:
      return c10::kShort;
    case Dtype::I8:
      return c10::kChar;
    case Dtype::U8:
      return c10::kByte;
    case Dtype::BOOL:
      return c10::kBool;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown checkpoint dtype");
}

}  // namespace mixprec::checkpoint
