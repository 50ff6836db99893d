// What every mixprec-ckpt command shares: exit statuses, the error type that carries one, and
// turning a command-line argument into a checkpoint directory.
//
// The tool's contract with scripts: a failure is exactly one line on stderr starting with
// "mixprec-ckpt: " and naming the file or key at fault, plus a non-zero exit status; nothing
// else is printed on stdout for a failed command.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mixprec::tools {

// Exit statuses, documented in `mixprec-ckpt --help`.
inline constexpr int kExitOk = 0;      // success; diff: identical
inline constexpr int kExitFailed = 1;  // verify: corrupt or malformed; diff: different
inline constexpr int kExitUsage = 2;   // bad arguments, unreadable path or file

// A failure the tool reports as "mixprec-ckpt: <message>" before exiting with `code`.
class ToolError : public std::runtime_error {
 public:
  ToolError(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// The checkpoint directory a command-line argument names (a trailing separator or a link to it
// changes nothing): the directory itself if it holds manifest.json, else, for a checkpoint
// root, the checkpoint loading it would take (checkpoint::find_checkpoint: the newest complete
// one; when that is not what `latest` names, a "note:" line on stderr says why). Throws
// ToolError(kExitUsage) naming the path if it does not exist, is not a directory, or is neither
// a checkpoint nor a root holding one. Reads tensor data only to verify a checkpoint newer than
// `latest`'s.
std::filesystem::path checkpoint_dir_from_arg(const std::string& arg);

// `message` as a single line: newlines (library messages may list several problems) become
// "; ", other control characters are shown escaped (\r, \t, \xNN: a name from a file or the
// command line is seen as it is), surrounding whitespace is trimmed. Never empty ("unknown
// error" instead).
std::string one_line(std::string_view message);

}  // namespace mixprec::tools
