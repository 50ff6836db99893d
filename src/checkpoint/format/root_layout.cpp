#include "mixprec/checkpoint/format/root_layout.h"

#include "fail.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "posix_file.h"

namespace mixprec::checkpoint {

void check_checkpoint_name(const std::filesystem::path& root, std::string_view name) {
  if (!is_valid_file_name(name)) {
    detail::fail(root.string(), ": '", name, "' is not a valid checkpoint name (1-200 ",
                 "characters of [A-Za-z0-9._-], not starting with '.')");
  }
  if (is_reserved_name(name)) {
    detail::fail(root.string(), ": '", name, "' is a reserved name in a checkpoint root (",
                 kLatestFileName, ", latest.*, ", kLockFileName,
                 "); choose another checkpoint name");
  }
}

Directory open_root(const std::filesystem::path& root, bool create) {
  if (create) detail::create_directories_durably(root);
  return Directory::open(root, Directory::Last::kMayBeLink);
}

}  // namespace mixprec::checkpoint
