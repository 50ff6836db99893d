// Text from the trained model: continue a prompt one byte at a time.
#pragma once

#include "plan.h"

#include <cstdint>
#include <string>

namespace train {

// Appends `n` bytes to `prompt`: each step runs the model on the last seq_len bytes and picks
// the next byte — the most likely one when temperature is 0, else drawn from
// softmax(logits / temperature) with a generator seeded by `seed` (the training RNG is not
// touched). Runs in eval mode without gradients; restores training mode. Returns the new bytes.
std::string generate(MixedModel& model, const std::string& prompt, int64_t n, double temperature,
                     uint64_t seed);

// `bytes` made printable: invalid UTF-8 and control characters other than newline and tab
// become '?', so a byte-level sample cannot garble the terminal.
std::string printable(const std::string& bytes);

}  // namespace train
