// Shared pieces of the fused-kernel tests: bitwise comparison and the "bad argument is
// named, nothing is written" check.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace mixprec::testing {

// Bit-for-bit equality (unlike torch::equal: -0 != +0, NaN == NaN with the same payload).
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto as_int = a.element_size() == 4 ? at::kInt : at::kShort;
  return at::equal(a.contiguous().view(as_int), b.contiguous().view(as_int));
}

// `call` must throw c10::Error "[mixprec::<op>] ...<message>..." and leave every tensor in
// `watched` (CPU ones; others cannot be read back here) as it was.
inline void expect_rejected(const std::function<void()>& call,
                            const std::vector<at::Tensor>& watched, const std::string& op,
                            const std::string& message) {
  std::vector<at::Tensor> before;
  for (const auto& t : watched) before.push_back(t.defined() ? t.clone() : t);
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.msg(), ::testing::HasSubstr("[mixprec::" + op + "]"));
    EXPECT_THAT(e.msg(), ::testing::HasSubstr(message));
  }
  for (size_t i = 0; i < watched.size(); ++i) {
    if (watched[i].defined() && watched[i].device().is_cpu()) {
      EXPECT_TRUE(same_bits(watched[i], before[i])) << "argument " << i << " was written";
    }
  }
}

// For each of `ts`, whether `call` changed its version counter (an in-place write bumps it).
inline std::vector<bool> bumped_by(const std::function<void()>& call,
                                   const std::vector<at::Tensor>& ts) {
  std::vector<uint32_t> before;
  for (const at::Tensor& t : ts) before.push_back(t._version());
  call();
  std::vector<bool> out;
  for (size_t i = 0; i < ts.size(); ++i) out.push_back(ts[i]._version() != before[i]);
  return out;
}

}  // namespace mixprec::testing
