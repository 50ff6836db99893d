// `mixprec-ckpt verify DIR`: reads every byte of a checkpoint and checks it against its
// manifest (checkpoint/format/verify.h: chunk dtypes, shapes, sizes, XXH3-64 checksums, the
// common file, no stray tensors).
#pragma once

#include <filesystem>
#include <ostream>

namespace mixprec::tools {

// On success writes one line "OK <dir>: <n> keys, <n> chunks, <n> files, <bytes> verified"
// and returns kExitOk. A corrupt or malformed checkpoint throws ToolError(kExitFailed) whose
// message is the library's (naming file, key and tensor), prefixed "verify failed: ".
int run_verify(const std::filesystem::path& dir, std::ostream& out);

}  // namespace mixprec::tools
