// Interoperability with the reference implementation: Python's `safetensors` package must
// read our files bit for bit, and we must read its files. Skipped when MIXPREC_PYTHON is not a
// python with safetensors and torch importable.
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"

#include "format_test_util.h"
#include "support/test_env.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using nlohmann::json;
using testing::pattern_bytes;
using testing::TempDir;

std::filesystem::path interop_script() {
  return std::filesystem::path(mixprec::test::source_dir()) /
         "tests/checkpoint/format/safetensors_interop.py";
}

// Runs a shell command; returns its stdout, or nullopt if it exited non-zero.
std::optional<std::string> run(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  return ::pclose(pipe) == 0 ? std::optional(out) : std::nullopt;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

class PythonInterop : public ::testing::Test {
 protected:
  void SetUp() override {
    python_ = mixprec::test::python();
    if (python_.empty()) GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  }

  json oracle(const std::string& mode, const std::filesystem::path& path) {
    auto out = run(quote(python_) + " " + quote(interop_script().string()) + " " + mode + " " +
                   quote(path.string()));
    if (!out) {
      ADD_FAILURE() << "the python oracle failed on " << path;
      return json::object();
    }
    return json::parse(*out);
  }

  std::string python_;
};

std::string hex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (std::byte b : bytes) {
    out += kDigits[static_cast<unsigned>(b) >> 4];
    out += kDigits[static_cast<unsigned>(b) & 15];
  }
  return out;
}

TEST_F(PythonInterop, PythonReadsWhatWeWrite) {
  TempDir dir;
  const auto path = dir.path() / "ours.safetensors";
  const std::vector<TensorSpec> specs = {{"model.layers.0.weight", Dtype::BF16, {4, 3}},
                                         {"master", Dtype::F32, {2, 2}},
                                         {"f16", Dtype::F16, {3}},
                                         {"f64", Dtype::F64, {2}},
                                         {"step", Dtype::I64, {}},
                                         {"i32", Dtype::I32, {1, 1, 2}},
                                         {"i16", Dtype::I16, {2}},
                                         {"i8", Dtype::I8, {5}},
                                         {"u8", Dtype::U8, {7}},
                                         {"fp8a", Dtype::F8_E4M3, {4}},
                                         {"fp8b", Dtype::F8_E5M2, {2, 2}},
                                         {"empty", Dtype::F32, {3, 0}}};
  std::vector<std::vector<std::byte>> data;
  {
    SafetensorsWriter writer(path, specs, {{"format", "pt"}, {"mixprec", "1"}});
    for (std::size_t i = 0; i < specs.size(); ++i) {
      data.push_back(pattern_bytes(specs[i].byte_size(), static_cast<std::uint32_t>(i)));
      if (!data.back().empty()) writer.write(specs[i].name, data.back());
    }
    writer.close();
  }
  // A BOOL tensor must hold 0/1 bytes to be meaningful to torch; write it separately.
  const auto bool_path = dir.path() / "bool.safetensors";
  {
    SafetensorsWriter writer(bool_path, {{"mask", Dtype::BOOL, {4}}});
    const std::byte bits[] = {std::byte{1}, std::byte{0}, std::byte{0}, std::byte{1}};
    writer.write("mask", bits);
    writer.close();
  }

  const json seen = oracle("read", path);
  EXPECT_EQ(seen["metadata"], (json{{"format", "pt"}, {"mixprec", "1"}}));
  ASSERT_EQ(seen["tensors"].size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const json& t = seen["tensors"][specs[i].name];
    EXPECT_EQ(t["dtype"], dtype_name(specs[i].dtype)) << specs[i].name;
    EXPECT_EQ(t["shape"], json(specs[i].shape)) << specs[i].name;
    EXPECT_EQ(t["hex"], hex(data[i])) << specs[i].name;
  }
  const json mask = oracle("read", bool_path)["tensors"]["mask"];
  EXPECT_EQ(mask["dtype"], "BOOL");
  EXPECT_EQ(mask["hex"], "01000001");
}

TEST_F(PythonInterop, WeReadWhatPythonWrites) {
  TempDir dir;
  const auto path = dir.path() / "theirs.safetensors";
  const json written = oracle("write", path);
  ASSERT_TRUE(written.contains("tensors"));
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.header().metadata.at("written_by"), "python");
  ASSERT_EQ(reader.header().tensors.size(), written["tensors"].size());
  for (const auto& [name, t] : written["tensors"].items()) {
    const TensorEntry& entry = reader.tensor(name);
    EXPECT_EQ(dtype_name(entry.dtype), t["dtype"].get<std::string>()) << name;
    EXPECT_EQ(json(entry.shape), t["shape"]) << name;
    std::vector<std::byte> bytes(entry.byte_size());
    reader.read(name, bytes);
    EXPECT_EQ(hex(bytes), t["hex"].get<std::string>()) << name;
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
