// SIGINT and SIGTERM as a request to stop: the loop finishes the step it is in, saves a
// checkpoint and the program exits with status 0. A second signal ends the process at once
// (the handler is installed with SA_RESETHAND, so the default action is back after the first).
#pragma once

namespace train {

class StopRequest {
 public:
  // Installs the handlers; the destructor restores the previous ones.
  StopRequest();
  ~StopRequest();
  StopRequest(const StopRequest&) = delete;
  StopRequest& operator=(const StopRequest&) = delete;

  bool requested() const;
  // The signal that asked (SIGINT or SIGTERM), 0 if none did.
  int signal_number() const;
};

}  // namespace train
