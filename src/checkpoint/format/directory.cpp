#include "mixprec/checkpoint/format/directory.h"

#include "fail.h"
#include "posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>

namespace mixprec::checkpoint {

Directory Directory::open(const std::filesystem::path& path, Last last) {
  detail::UniqueFd fd = detail::open_directory(path, last == Last::kMayBeLink);
  return Directory(detail::without_trailing_separators(path), fd.release());
}

Directory Directory::subdirectory(std::string_view name) const {
  const std::filesystem::path path = path_ / name;
  detail::UniqueFd fd = detail::open_directory_at(fd_, name, path);
  return Directory(path, fd.release());
}

Directory Directory::duplicate() const {
  const int fd = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) detail::fail_errno(path_, "dup");
  return Directory(path_, fd);
}

void Directory::remove_tree(std::string_view name) const {
  detail::remove_tree_at(fd_, name, path_ / name);
}

Directory::~Directory() {
  if (fd_ >= 0) ::close(fd_);
}

Directory::Directory(Directory&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

Directory& Directory::operator=(Directory&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

}  // namespace mixprec::checkpoint
