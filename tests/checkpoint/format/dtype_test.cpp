#include "mixprec/checkpoint/format/dtype.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

TEST(Dtype, NamesRoundTripAndSizesMatchSafetensors) {
  const std::pair<std::string_view, std::size_t> expected[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U8", 1},      {"BOOL", 1}};
  for (const auto& [name, size] : expected) {
    auto dtype = parse_dtype(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(dtype_name(*dtype), name);
    EXPECT_EQ(element_size(*dtype), size) << name;
  }
}

TEST(Dtype, RejectsUnknownAndMiscasedNames) {
  for (std::string_view name : {"", "f32", "FP32", "U16", "F8_E8M0", "BF16 ", "float32"}) {
    EXPECT_FALSE(parse_dtype(name).has_value()) << "'" << name << "'";
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
