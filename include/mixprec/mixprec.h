// mixprec's public API in one include, as <torch/torch.h> is LibTorch's:
//
//   #include <mixprec/mixprec.h>
//
// In the order data flows: the precision plan and conversion (which tensors stay FP32), the
// quantization scopes, the mixed-precision optimizer, the FQN-keyed state dicts, checkpoints
// and their LibTorch-free on-disk format. Also the LibTorch option types Float16Optimizer
// takes (AdamWOptions, AdamOptions, SGDOptions). It does not include <torch/torch.h>: add it
// (or the torch::nn module headers you use) for LibTorch's layers.
//
// Every public header of include/mixprec/ outside detail/ is listed here; a test
// (install.umbrella_header_complete) keeps it so.
#pragma once

// Precision plan: keep_in_fp32, PrecisionPlan, conversion, Float16Module; the FP32 loss of
// half-precision logits.
#include "mixprec/precision/convert.h"
#include "mixprec/precision/cross_entropy.h"
#include "mixprec/precision/float16_module.h"
#include "mixprec/precision/keep_fp32.h"
#include "mixprec/precision/module_clone.h"
#include "mixprec/precision/precision_plan.h"

// Quantization scopes (FP8 / FP4) and the layer that honours them.
#include "mixprec/quant/fake_quant.h"
#include "mixprec/quant/operand_cache.h"
#include "mixprec/quant/quant_config.h"
#include "mixprec/quant/quant_linear.h"
#include "mixprec/quant/quant_state.h"

// Mixed-precision optimizer.
#include "mixprec/optim/float16_optimizer.h"
#include "mixprec/optim/fused_kernels.h"
#include "mixprec/optim/hyper_params.h"
#include "mixprec/optim/loss_scaler.h"
#include "mixprec/optim/master_remainder.h"
#include "mixprec/optim/offload.h"
#include "mixprec/optim/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

// State dicts keyed by fully qualified names.
#include "mixprec/sharded_state_dict.h"

// Checkpoints: training state, save/load, resharding, async save.
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/reshard.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/checkpoint/tensor_dtype.h"
#include "mixprec/checkpoint/training_state.h"

// The on-disk format (LibTorch-free; also usable alone through mixprec::format).
#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/dtype.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "mixprec/checkpoint/format/root_lock.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/safetensors_header.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/checkpoint/format/verify.h"

// Data parallelism on c10d: process groups, gradient reduction, the ZeRO-1 optimizer and its
// collective checkpoints.
#include "mixprec/distributed/buffer_layout.h"
#include "mixprec/distributed/collective_checkpoint.h"
#include "mixprec/distributed/communicator.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/distributed/init.h"
#include "mixprec/distributed/model_check.h"
