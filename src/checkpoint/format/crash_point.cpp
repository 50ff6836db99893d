#include "mixprec/checkpoint/format/crash_point.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

namespace mixprec::checkpoint::detail {
namespace {

// kill_at: 0 = off, -1 = list, -2 = slow, n > 0 = kill at the n-th point.
std::atomic<long long> kill_at{0};
std::atomic<std::uint64_t> reached{0};
std::once_flag configured;
// "slow:<label>:<ms>": the label and the pause (written before kill_at says -2).
std::string slow_label;
std::chrono::milliseconds slow_pause{0};

void configure() {
  const char* value = std::getenv("MIXPREC_CRASH_POINT");
  long long mode = 0;
  const std::string_view text = value != nullptr ? value : "";
  const size_t last_colon = text.rfind(':');
  if (text == "list") {
    mode = -1;
  } else if (text.starts_with("slow:") && last_colon > 4 && last_colon + 1 < text.size() &&
             text.find_first_not_of("0123456789", last_colon + 1) == std::string_view::npos) {
    slow_label = std::string(text.substr(5, last_colon - 5));
    slow_pause = std::chrono::milliseconds(std::atoll(value + last_colon + 1));
    mode = -2;
  } else if (value != nullptr && *value != '\0') {
    char* end = nullptr;
    long long n = std::strtoll(value, &end, 10);
    // A malformed value must not silently disable a crash test: say so once.
    if (*end != '\0' || n < 0) {
      std::fprintf(stderr, "mixprec: ignoring malformed MIXPREC_CRASH_POINT='%s'\n", value);
    } else {
      mode = n;
    }
  }
  kill_at.store(mode, std::memory_order_relaxed);
}

}  // namespace

void crash_point(const char* label) {
  std::call_once(configured, configure);
  const std::uint64_t n = reached.fetch_add(1, std::memory_order_relaxed) + 1;
  const long long mode = kill_at.load(std::memory_order_relaxed);
  if (mode == 0) return;
  if (mode == -1) {
    std::fprintf(stderr, "mixprec crash point %llu: %s\n", static_cast<unsigned long long>(n),
                 label);
    return;
  }
  if (mode == -2) {
    if (slow_label == label) std::this_thread::sleep_for(slow_pause);
    return;
  }
  if (n == static_cast<std::uint64_t>(mode)) {
    std::fprintf(stderr, "mixprec: crash point %llu (%s): raising SIGKILL\n",
                 static_cast<unsigned long long>(n), label);
    std::raise(SIGKILL);
  }
}

std::uint64_t crash_points_reached() { return reached.load(std::memory_order_relaxed); }

void reset_crash_points() {
  std::call_once(configured, [] {});
  configure();
  reached.store(0, std::memory_order_relaxed);
}

}  // namespace mixprec::checkpoint::detail
