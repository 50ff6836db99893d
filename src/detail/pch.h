// Precompiled header: the LibTorch headers nearly every translation unit includes.
// Narrow on purpose: <torch/torch.h> would pull in all of the C++ frontend.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/types.h>
