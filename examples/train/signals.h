// SIGINT and SIGTERM as a request to stop: the loop finishes the step it is in, saves a
// checkpoint and the program exits with status 0. Further SIGTERMs change nothing (a cluster's
// launcher and its step daemon often both send one), to the end of the process: one that
// comes while the program winds down must not turn a clean exit into a kill. A second SIGINT —
// a person pressing Ctrl-C again — ends the process at once (SA_RESETHAND restores the
// default action). A signal the process started with ignored stays ignored (a background job
// of a shell, which ignores SIGINT for it): it is no request.
#pragma once

namespace train {

class StopRequest {
 public:
  // Installs the handlers; the destructor restores SIGINT's previous one (SIGTERM's stays).
  StopRequest();
  ~StopRequest();
  StopRequest(const StopRequest&) = delete;
  StopRequest& operator=(const StopRequest&) = delete;

  bool requested() const;
  // The signal that asked (SIGINT or SIGTERM), 0 if none did.
  int signal_number() const;
};

}  // namespace train
