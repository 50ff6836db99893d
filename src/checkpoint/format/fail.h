// Building FormatError messages: one prefix, the parts streamed in order.
#pragma once

#include "mixprec/checkpoint/format/error.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <string_view>

namespace mixprec::checkpoint::detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// `text` (a name read from a file, which may hold any byte) as an error message can show it:
// control characters written as \n, \r, \t or \xNN and a backslash as \\, so that the message
// stays one line and a name with a stray "\r" does not look like a valid one.
inline std::string printable(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      out += {'\\', 'x', kHex[byte >> 4], kHex[byte & 0xf]};
    } else {
      out += c;
    }
  }
  return out;
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
