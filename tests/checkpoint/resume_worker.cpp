// Runs part of a training job in its own process, for the bitwise-resume test.
//
//   resume_worker straight <root> <dtype> <N>       train N steps, save "final"
//   resume_worker first    <root> <dtype> <k>       train k steps, save "step-k"
//   resume_worker resume   <root> <dtype> <N>       load <root>/latest, train to N, save "final"
// <dtype> is bf16 or fp16. The step count travels in the checkpoint's user metadata.
#include "checkpoint/support_training.h"
#include "mixprec/checkpoint/training_state.h"

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: resume_worker straight|first|resume ROOT bf16|fp16 STEPS\n");
    return 2;
  }
  const std::string mode = argv[1];
  const std::filesystem::path root = argv[2];
  const c10::ScalarType half = std::string(argv[3]) == "fp16" ? at::kHalf : at::kBFloat16;
  const int steps = std::atoi(argv[4]);
  try {
    at::set_num_threads(1);
    mixprec::testing::TrainingSetup setup(half);
    int done = 0;
    at::manual_seed(2026);  // the data order
    if (mode == "resume") {
      auto resumed = mixprec::checkpoint::load_training_state(root, *setup.model, *setup.optimizer);
      done = resumed.user.at("steps_done").get<int>();
    }
    for (; done < steps; ++done) setup.step();
    const std::string name = mode == "first" ? "step-" + std::to_string(done) : "final";
    mixprec::checkpoint::save_training_state(root, name, *setup.model, *setup.optimizer,
                                             {{"steps_done", done}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "resume_worker: %s\n", e.what());
    return 1;
  }
  return 0;
}
