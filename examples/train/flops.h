// Model FLOPs utilisation (MFU), as Megatron-LM and torchtitan report it: the FLOPs a step of
// this model needs, over the time it took, against the machine's peak for the GEMMs it runs.
#pragma once

#include "config.h"

namespace train {

// Training FLOPs per token of the model `config` describes: 6 per active matmul parameter
// (2 forward, 4 backward), counting the attention projections, the top-k experts a token is
// routed to (not all experts), the router and the tied LM head, plus the attention scores and
// their weighted sum, 12 · layers · d_model · seq_len (PaLM's convention: the causal mask's
// skipped half is counted, as everyone reporting MFU does). Embedding lookups, norms, softmax
// and the element-wise work are not counted: they are not what the peak measures.
double training_flops_per_token(const TrainConfig& config);

// Matmul parameters one token goes through (forward): the 6 · N of the formula above.
double active_matmul_params(const TrainConfig& config);

// This machine's BF16 GEMM rate in FLOP/s, measured now with the current intra-op threads: the
// best of a few 1024 × 1024 × 1024 BF16 matmuls after one warm-up (about 0.1 s in all on two
// cores). The denominator of MFU: what LibTorch's GEMM reaches here, not a datasheet figure.
double measure_bf16_gemm_flops();

}  // namespace train
