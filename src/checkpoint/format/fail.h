// Building FormatError messages: one prefix, the parts streamed in order.
#pragma once

#include "mixprec/checkpoint/format/error.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string_view>

namespace mixprec::checkpoint::detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// Throws FormatError("[mixprec::checkpoint] " + parts...).
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw FormatError(concat("[mixprec::checkpoint] ", parts...));
}

// Throws FormatError "<path>: <what>: <strerror(err)>" for a failed system call.
[[noreturn]] inline void fail_errno(const std::filesystem::path& path, std::string_view what,
                                    int err = errno) {
  fail(path.string(), ": ", what, ": ", std::strerror(err));
}

}  // namespace mixprec::checkpoint::detail
