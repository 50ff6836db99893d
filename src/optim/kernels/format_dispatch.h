// From run-time stream formats to compile-time kernel instantiations, in one place.
//
// Every SIMD kernel is a template over the formats of the streams it reads and writes
// (GradFormat, ModelFormat): the per-element code is then branch-free, and each combination is
// compiled once per Highway target. These helpers turn the run-time formats of one call into
// the matching instantiation: they call `fn` with std::integral_constant tags, which convert
// to their value in constant expressions, so a kernel writes
//
//   dispatch_formats(b.grad_format, b.model_format,
//                    [&](auto g, auto m) { AdamRange<g, m>(b, c, begin, end); });
//
// Plain C++ (no Highway): usable inside and outside the per-target namespaces.
#pragma once

#include <type_traits>

#include "kernel_args.h"  // a sibling: tests include this header by its path

namespace mixprec::optim::detail {

template <GradFormat G>
using GradTag = std::integral_constant<GradFormat, G>;
template <ModelFormat M>
using ModelTag = std::integral_constant<ModelFormat, M>;

// fn(GradTag<G>{}) for the G equal to `grad`.
template <class Fn>
decltype(auto) dispatch_grad_format(GradFormat grad, Fn&& fn) {
  switch (grad) {
    case GradFormat::kBF16:
      return fn(GradTag<GradFormat::kBF16>{});
    case GradFormat::kF16:
      return fn(GradTag<GradFormat::kF16>{});
    case GradFormat::kF32:
      break;
  }
  return fn(GradTag<GradFormat::kF32>{});
}

// fn(ModelTag<M>{}) for the M equal to `model`.
template <class Fn>
decltype(auto) dispatch_model_format(ModelFormat model, Fn&& fn) {
  switch (model) {
    case ModelFormat::kBF16:
      return fn(ModelTag<ModelFormat::kBF16>{});
    case ModelFormat::kF16:
      return fn(ModelTag<ModelFormat::kF16>{});
    case ModelFormat::kBF16Remainder:
      return fn(ModelTag<ModelFormat::kBF16Remainder>{});
    case ModelFormat::kNone:
      break;
  }
  return fn(ModelTag<ModelFormat::kNone>{});
}

// fn(GradTag<G>{}, ModelTag<M>{}) for the pair (G, M) equal to (grad, model).
template <class Fn>
decltype(auto) dispatch_formats(GradFormat grad, ModelFormat model, Fn&& fn) {
  return dispatch_grad_format(grad, [&](auto g) -> decltype(auto) {
    return dispatch_model_format(model, [&](auto m) -> decltype(auto) { return fn(g, m); });
  });
}

}  // namespace mixprec::optim::detail
