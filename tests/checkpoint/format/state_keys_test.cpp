// The reserved checkpoint names have one home, state_keys.h; the Python reader
// (python/mixprec_reader.py) spells them too, and must spell them the same. The test reads
// every `kName = "value"` constant from the header's text (checked against the compiled
// constants, so the parse cannot silently find nothing) and compares them with the names the
// Python module exposes (kOptimizerStatePrefix -> OPTIMIZER_STATE_PREFIX), in both directions.
// Skipped when MIXPREC_PYTHON cannot import torch and safetensors.
#include "mixprec/checkpoint/format/state_keys.h"
#include "support/test_env.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;

fs::path source() { return mixprec::test::source_dir(); }

std::optional<std::string> run(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  return ::pclose(pipe) == 0 ? std::optional(out) : std::nullopt;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

// kOptimizerStatePrefix -> OPTIMIZER_STATE_PREFIX.
std::string python_name(const std::string& cpp) {
  std::string out;
  for (std::size_t i = 1; i < cpp.size(); ++i) {
    const char c = cpp[i];
    if (std::isupper(static_cast<unsigned char>(c)) && i > 1) out += '_';
    out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return out;
}

// Every `constexpr std::string_view kName = "value";` of the header, and the members of
// `constexpr std::array<std::string_view, N> kName = {kA, kB, ...};` resolved to values.
nlohmann::json header_names() {
  std::ifstream in(source() / "include/mixprec/checkpoint/format/state_keys.h");
  std::stringstream text;
  text << in.rdbuf();
  const std::string header = text.str();
  nlohmann::json out = nlohmann::json::object();
  const std::regex scalar(R"re(constexpr std::string_view (k\w+) = "([^"]*)";)re");
  for (std::sregex_iterator it(header.begin(), header.end(), scalar), end; it != end; ++it) {
    out[python_name((*it)[1])] = (*it)[2].str();
  }
  const std::regex array(
      R"re(constexpr std::array<std::string_view, \d+> (k\w+) = \{([^}]*)\};)re");
  for (std::sregex_iterator it(header.begin(), header.end(), array), end; it != end; ++it) {
    nlohmann::json values = nlohmann::json::array();
    const std::string members = (*it)[2];
    const std::regex member(R"(k\w+)");
    for (std::sregex_iterator m(members.begin(), members.end(), member); m != end; ++m) {
      values.push_back(out.at(python_name(m->str())));
    }
    out[python_name((*it)[1])] = values;
  }
  return out;
}

TEST(StateKeys, HeaderParseSeesTheCompiledConstants) {
  const nlohmann::json names = header_names();
  EXPECT_EQ(names.at("OPTIMIZER_STATE_PREFIX"), std::string(keys::kOptimizerStatePrefix));
  EXPECT_EQ(names.at("FP32_PARAM"), std::string(keys::kFp32Param));
  EXPECT_EQ(names.at("RNG_CPU"), std::string(keys::kRngCpu));
  EXPECT_EQ(names.at("COMMON_PRECISION"), std::string(keys::kCommonPrecision));
  EXPECT_EQ(names.at("KEPT_BY_PATTERN"), std::string(keys::kKeptByPattern));
  EXPECT_EQ(names.at("WITHOUT_STATE"), std::string(keys::kWithoutState));
  ASSERT_EQ(names.at("STATE_KINDS").size(), keys::kStateKinds.size());
  for (std::size_t i = 0; i < keys::kStateKinds.size(); ++i) {
    EXPECT_EQ(names.at("STATE_KINDS")[i], std::string(keys::kStateKinds[i]));
  }
  EXPECT_GE(names.size(), 24u) << names.dump(1);  // as many as the header had when written
}

TEST(StateKeys, PythonReaderUsesTheSameNames) {
  const std::string python = mixprec::test::python();
  if (python.empty()) GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  const std::string script =
      "import sys, json; sys.path.insert(0, sys.argv[1]); import mixprec_reader as m; "
      "print(json.dumps({\"names\": m.names(), "
      "\"state_key\": m.optimizer_state_key(\"exp_avg\", \"blocks.0.w\")}))";
  const auto out =
      run(quote(python) + " -c " + quote(script) + " " + quote((source() / "python").string()));
  ASSERT_TRUE(out) << "the python module failed to load";
  const nlohmann::json python_side = nlohmann::json::parse(*out);
  const nlohmann::json header = header_names();
  for (const auto& [name, value] : header.items()) {
    ASSERT_TRUE(python_side["names"].contains(name)) << "mixprec_reader.py lacks " << name;
    EXPECT_EQ(python_side["names"][name], value) << name;
  }
  for (const auto& [name, value] : python_side["names"].items()) {
    EXPECT_TRUE(header.contains(name))
        << "mixprec_reader.py reserves " << name << " = " << value << ", state_keys.h does not";
  }
  EXPECT_EQ(python_side["state_key"], keys::optimizer_state_key(keys::kExpAvg, "blocks.0.w"));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
