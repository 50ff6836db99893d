#include "ckpt/cli.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/load.h"

#include <system_error>

namespace mixprec::tools {

namespace fs = std::filesystem;

CheckpointArg checkpoint_from_arg(const std::string& arg, Notes& notes, int damaged_status) {
  if (arg.empty()) throw ToolError(kExitUsage, "empty checkpoint path");
  // "ckpt/", "ckpt/." and "ckpt" name one checkpoint, and must report it alike (export writes
  // the directory's name into its metadata): no trailing separator.
  fs::path path = fs::path(arg).lexically_normal();
  if (!path.has_filename() && path.has_parent_path() && path != path.root_path()) {
    path = path.parent_path();
  }
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
  // A link the user names is how they name the directory it points to. Inside a checkpoint the
  // library refuses links (a file swapped for one is damage); the argument itself is not.
  if (fs::is_symlink(fs::symlink_status(path, ec))) {
    path = fs::canonical(path, ec);
    if (ec) throw ToolError(kExitUsage, arg + ": " + ec.message());
  }
  // A root: the checkpoint loading it would take (the newest complete one, which `latest`
  // names unless a save ended between its commit and the `latest` update). Those problems are
  // the caller's path, not corruption of a checkpoint: the usage status; except a root whose
  // checkpoints are all damaged, which the caller may report as damage.
  try {
    checkpoint::ResolvedCheckpoint resolved = checkpoint::find_checkpoint(path);
    if (!resolved.note.empty()) notes.push_back(resolved.note);
    return {resolved.dir, resolved.dir != path, std::move(resolved.skipped)};
  } catch (const checkpoint::NoIntactCheckpointError& e) {
    throw ToolError(damaged_status, one_line(e.what()));
  } catch (const checkpoint::FormatError& e) {
    throw ToolError(kExitUsage, one_line(e.what()));
  }
}

std::string one_line(std::string_view message) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(message.size());
  // Only the indentation of a list's lines ("...:\n  - a\n  - b" → "...:; - a; - b") is dropped:
  // spaces inside a line may be part of a name ("my  run"), which is shown as it is.
  bool line_start = false;
  for (char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    if (line_start && c == ' ') continue;
    line_start = false;
    if (c == '\n') {
      out += "; ";
      line_start = true;
    } else if (c == '\r') {
      // Shown, not dropped: a name read as "step-10\r" must not print as the valid "step-10".
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      out += {'\\', 'x', kHex[byte >> 4], kHex[byte & 0xf]};
    } else {
      out += c;
    }
  }
  const auto first = out.find_first_not_of(" ;");
  if (first == std::string::npos) return "unknown error";
  const auto last = out.find_last_not_of(" ;");
  return out.substr(first, last - first + 1);
}

}  // namespace mixprec::tools
