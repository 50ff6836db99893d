// The message of the c10::Error a call throws ("" if it throws none), for asserting that an
// error names the thing at fault.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace mixprec::testing {

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace mixprec::testing
