// Element types of checkpoint tensors, named as safetensors names them.
//
// The names ("F32", "BF16", "F8_E4M3", ...) are the on-disk spelling in both safetensors
// headers and manifest.json; they are part of the format and never change meaning. Mapping
// to and from torch ScalarTypes lives in the LibTorch layer, not here.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace mixprec::checkpoint {

enum class Dtype {
  F64,
  F32,
  F16,
  BF16,
  F8_E4M3,  // torch.float8_e4m3fn
  F8_E5M2,  // torch.float8_e5m2
  I64,
  I32,
  I16,
  I8,
  U8,
  BOOL,  // one byte per element, 0 or 1 (the bytes are not checked)
};

// The safetensors name of `dtype`, e.g. "BF16". Never throws.
std::string_view dtype_name(Dtype dtype);

// Bytes per element (8, 4, 2 or 1). Never throws.
std::size_t element_size(Dtype dtype);

// Inverse of dtype_name; exact, case-sensitive match. nullopt for any other string
// (including safetensors dtypes this project does not use, such as "U16" or "F8_E8M0").
std::optional<Dtype> parse_dtype(std::string_view name);

}  // namespace mixprec::checkpoint
