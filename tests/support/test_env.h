// Paths a test needs at run time: the source tree, the oracle Python, the programs it starts.
//
// ctest puts them in every test's environment (tests/CMakeLists.txt, mixprec_test_environment),
// rather than the build compiling them into the test binaries: an absolute path in a compile
// definition makes every object file differ between two clones of the same commit, and the
// compiler cache could never serve one clone's objects to the other. Plain C++ (no LibTorch):
// the format layer's tests use it too.
#pragma once

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace mixprec::test {

// The value of environment variable `name`; empty when unset.
inline std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

// The value of `name`; throws std::runtime_error naming it when unset or empty (the test was
// run outside ctest: set it by hand).
inline std::string required_env(const char* name) {
  std::string value = env_or_empty(name);
  if (value.empty()) {
    throw std::runtime_error(std::string(name) +
                             " is not set: run the test through ctest, which sets it "
                             "(tests/CMakeLists.txt), or set it by hand");
  }
  return value;
}

// The repository root.
inline std::string source_dir() { return required_env("MIXPREC_SOURCE_DIR"); }
// The build directory.
inline std::string binary_dir() { return required_env("MIXPREC_BINARY_DIR"); }
// A Python that imports torch and safetensors (the oracles); empty when the build found none.
// CMake probed it when it configured (tests/CMakeLists.txt): tests need not import torch to ask.
inline std::string python() { return env_or_empty("MIXPREC_PYTHON"); }
// torchrun beside that Python; empty when there is none.
inline std::string torchrun() { return env_or_empty("MIXPREC_TORCHRUN"); }
// Whether this is the sanitized pass (ASan + UBSan; tests/CMakeLists.txt sets the variable for
// its entries), where instrumented code runs several times slower.
inline bool sanitized_pass() { return env_or_empty("MIXPREC_SANITIZED_PASS") == "1"; }

// Sets environment variable `name` to `value` for its own lifetime, then restores what was
// there (or unsets it).
class ScopedEnvironmentVariable {
 public:
  ScopedEnvironmentVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnvironmentVariable() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnvironmentVariable(const ScopedEnvironmentVariable&) = delete;
  ScopedEnvironmentVariable& operator=(const ScopedEnvironmentVariable&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace mixprec::test
