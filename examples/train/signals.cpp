#include "signals.h"

#include <csignal>

namespace train {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
struct sigaction g_previous_int, g_previous_term;

extern "C" void on_stop_signal(int signal_number) { g_stop_signal = signal_number; }

}  // namespace

StopRequest::StopRequest() {
  g_stop_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND | SA_RESTART;  // a second signal gets the default action
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
}

StopRequest::~StopRequest() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
}

bool StopRequest::requested() const { return g_stop_signal != 0; }
int StopRequest::signal_number() const { return g_stop_signal; }

}  // namespace train
