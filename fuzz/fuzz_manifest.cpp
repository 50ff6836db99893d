// libFuzzer target: manifest.json text.
//
// Property: parse_manifest either throws FormatError or returns a manifest that validates and
// survives a serialize → parse round trip unchanged. Anything else is a bug.
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"

#include <cstdint>
#include <cstdlib>
#include <string_view>

using namespace mixprec::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Manifest manifest;
  try {
    manifest = parse_manifest(text, "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  const std::string once = manifest_to_json(manifest);
  const std::string twice = manifest_to_json(parse_manifest(once, "round-trip"));
  if (once != twice) std::abort();
  return 0;
}
