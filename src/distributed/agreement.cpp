#include "distributed/agreement.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <future>

namespace mixprec::distributed::detail {

namespace {

// Whatever a part throws (c10::Error, the format layer's FormatError, std::bad_alloc) becomes
// a message: every rank raises one error type with the same text.
std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

std::vector<std::string> agree(Communicator& comm, std::string_view op,
                               const std::function<std::string()>& part) {
  // The outcome's mark, then its payload. (Appended: GCC 12 warns, wrongly, about
  // `"+" + part()` once inlined, PR 105651.)
  std::string mine(1, '+');
  try {
    mine += part();
  } catch (...) {
    mine = "-";
    mine += message_of(std::current_exception());
  }
  std::vector<std::string> all = comm.all_gather_strings(mine);
  int first = -1, failed = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_INTERNAL_ASSERT(!all[r].empty(), "rank ", r, " sent no outcome");
    if (all[r][0] == '+') continue;
    ++failed;
    if (first < 0) first = static_cast<int>(r);
  }
  TORCH_CHECK(first < 0, "[", op, "] failed on rank ", first, " of ", all.size(), " (", failed,
              " rank(s) failed): ", first < 0 ? "" : all[first].substr(1));
  for (std::string& payload : all) payload.erase(0, 1);
  return all;
}

std::string agree_on_one_ranks_part(Communicator& comm, std::string_view op, int worker,
                                    const std::function<std::string()>& part) {
  const bool working = comm.rank() == worker;
  const std::chrono::milliseconds slice = comm.timeout() / 4;
  std::future<std::string> answer;
  std::exception_ptr not_started;  // no thread: the part fails, in the first agreement
  if (working) {
    try {
      answer = std::async(std::launch::async, part);
    } catch (...) {
      not_started = std::current_exception();
    }
  }
  for (;;) {
    // The worker says "" while the part runs, then "=" and its payload (or its error, which
    // agree() raises on every rank).
    const std::vector<std::string> said = agree(comm, op, [&]() -> std::string {
      if (!working) return {};
      if (not_started) std::rethrow_exception(not_started);
      if (answer.wait_for(slice) != std::future_status::ready) return {};
      return "=" + answer.get();
    });
    const std::string& news = said.at(static_cast<size_t>(worker));
    if (!news.empty()) return news.substr(1);
  }
}

}  // namespace mixprec::distributed::detail
