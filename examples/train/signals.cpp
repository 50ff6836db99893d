#include "signals.h"

#include <csignal>

namespace train {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
struct sigaction g_previous_int;

extern "C" void on_stop_signal(int signal_number) { g_stop_signal = signal_number; }

// Installs `action` for `signal` unless the process started with it ignored: a shell starts a
// background job with SIGINT ignored, so that a Ctrl-C meant for the foreground job does not
// reach it, and a launcher may ignore SIGTERM on purpose. `previous` gets the old action.
void install_unless_ignored(int signal, const struct sigaction& action,
                            struct sigaction* previous) {
  struct sigaction current {};
  sigaction(signal, nullptr, &current);
  if (previous != nullptr) *previous = current;
  if (current.sa_handler == SIG_IGN) return;
  sigaction(signal, &action, nullptr);
}

}  // namespace

StopRequest::StopRequest() {
  g_stop_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  // SIGTERM stays handled: under SLURM the step daemon and the launcher both send one,
  // milliseconds apart, and the second must not kill the save the first one asked for.
  action.sa_flags = SA_RESTART;
  install_unless_ignored(SIGTERM, action, nullptr);
  // A second Ctrl-C is a person insisting: it gets the default action (the process ends).
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  install_unless_ignored(SIGINT, action, &g_previous_int);
}

StopRequest::~StopRequest() { sigaction(SIGINT, &g_previous_int, nullptr); }

bool StopRequest::requested() const { return g_stop_signal != 0; }
int StopRequest::signal_number() const { return g_stop_signal; }

}  // namespace train
