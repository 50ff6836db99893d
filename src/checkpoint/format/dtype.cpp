#include "mixprec/checkpoint/format/dtype.h"

#include <array>

namespace mixprec::checkpoint {
namespace {

struct DtypeInfo {
  Dtype dtype;
  std::string_view name;
  std::size_t size;
};

// Order matches the enum, so dtype_name/element_size index directly.
constexpr std::array<DtypeInfo, 12> kDtypes{{
    {Dtype::F64, "F64", 8},
    {Dtype::F32, "F32", 4},
    {Dtype::F16, "F16", 2},
    {Dtype::BF16, "BF16", 2},
    {Dtype::F8_E4M3, "F8_E4M3", 1},
    {Dtype::F8_E5M2, "F8_E5M2", 1},
    {Dtype::I64, "I64", 8},
    {Dtype::I32, "I32", 4},
    {Dtype::I16, "I16", 2},
    {Dtype::I8, "I8", 1},
    {Dtype::U8, "U8", 1},
    {Dtype::BOOL, "BOOL", 1},
}};

constexpr bool table_matches_enum() {
  for (std::size_t i = 0; i < kDtypes.size(); ++i) {
    if (static_cast<std::size_t>(kDtypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(table_matches_enum(), "kDtypes must list Dtype values in enum order");

}  // namespace

std::string_view dtype_name(Dtype dtype) { return kDtypes[static_cast<std::size_t>(dtype)].name; }

std::size_t element_size(Dtype dtype) { return kDtypes[static_cast<std::size_t>(dtype)].size; }

std::optional<Dtype> parse_dtype(std::string_view name) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

}  // namespace mixprec::checkpoint
