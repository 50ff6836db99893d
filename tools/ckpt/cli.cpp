#include "ckpt/cli.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"

#include <system_error>

namespace mixprec::tools {

namespace fs = std::filesystem;

fs::path checkpoint_dir_from_arg(const std::string& arg) {
  if (arg.empty()) throw ToolError(kExitUsage, "empty checkpoint path");
  const fs::path path(arg);
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  // status() reports "not found" through the type, other failures (EACCES...) through ec.
  if (status.type() == fs::file_type::not_found) {
    throw ToolError(kExitUsage, arg + ": no such file or directory");
  }
  if (ec) throw ToolError(kExitUsage, arg + ": " + ec.message());
  if (!fs::is_directory(status)) {
    throw ToolError(kExitUsage,
                    arg + ": not a directory (expected a checkpoint directory or root)");
  }
  if (fs::exists(path / checkpoint::kManifestFileName, ec)) return path;
  // Not a checkpoint itself: a root, whose `latest` names the checkpoint. read_latest rejects
  // a malformed pointer or one naming a missing directory; those are the caller's path
  // problems, not corruption of a checkpoint, hence the usage status.
  std::optional<std::string> latest;
  try {
    latest = checkpoint::read_latest(path);
  } catch (const checkpoint::FormatError& e) {
    throw ToolError(kExitUsage, e.what());
  }
  if (!latest) {
    throw ToolError(kExitUsage, arg + ": neither a checkpoint (no manifest.json) nor a " +
                                    "checkpoint root (no 'latest' file)");
  }
  return path / *latest;
}

std::string one_line(std::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (char c : message) {
    if (c == '\n') {
      out += "; ";
    } else if (c != '\r') {
      out += c;
    }
  }
  // Collapse the "; " runs that indented multi-line lists leave ("...:;   - a;   - b").
  std::string squeezed;
  for (char c : out) {
    if (c == ' ' && !squeezed.empty() && squeezed.back() == ' ') continue;
    squeezed += c;
  }
  const auto first = squeezed.find_first_not_of(" ;");
  if (first == std::string::npos) return "unknown error";
  const auto last = squeezed.find_last_not_of(" ;");
  return squeezed.substr(first, last - first + 1);
}

}  // namespace mixprec::tools
