// Conversion and read-only passes, compiled once per Highway target and selected at run time:
// FP32 main copy -> BF16/FP16 model parameter, FP32 master <-> BF16 param + remainder, and the
// gradient's sum of squares for clipping and overflow detection.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/kernels/convert_simd.cpp"
#include <hwy/foreach_target.h>  // must precede highway.h
#include <hwy/highway.h>

#include <algorithm>

#include "optim/kernels/format_dispatch.h"
#include "optim/kernels/kernel_args.h"
#include "optim/kernels/simd_convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace mixprec::optim::detail::HWY_NAMESPACE {
namespace {

template <ModelFormat M>
void MasterToModelRange(const float* HWY_RESTRICT master, uint16_t* HWY_RESTRICT model,
                        size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  size_t i = begin;
  for (; i + lanes <= end; i += lanes) StoreModel<M>(d, hn::LoadU(d, master + i), model, i);
  if (i == end) return;
  HWY_ALIGN float in[kMaxFloatLanes] = {};
  HWY_ALIGN uint16_t out[kMaxFloatLanes] = {};
  std::copy_n(master + i, end - i, in);
  StoreModel<M>(d, hn::Load(d, in), out, 0);
  std::copy_n(out, end - i, model + i);
}

// Squares are summed in double: exact for each FP32 square, and four independent
// accumulators keep the adds pipelined. Float inputs cannot overflow a double sum (at most
// 2^256 per element), so the sum is non-finite exactly when some input is Inf or NaN.
template <GradFormat G>
double SumOfSquaresRange(const GradElement<G>* HWY_RESTRICT grad, size_t begin, size_t end) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const size_t lanes = hn::Lanes(dd);
  auto acc0 = hn::Zero(dd), acc1 = hn::Zero(dd), acc2 = hn::Zero(dd), acc3 = hn::Zero(dd);
  auto square_add = [&](const GradElement<G>* src, size_t i, decltype(acc0) acc) {
    const auto x = hn::PromoteTo(dd, LoadGrad<G>(df, src, i));
    return hn::MulAdd(x, x, acc);
  };
  size_t i = begin;
  for (; i + 4 * lanes <= end; i += 4 * lanes) {
    acc0 = square_add(grad, i, acc0);
    acc1 = square_add(grad, i + lanes, acc1);
    acc2 = square_add(grad, i + 2 * lanes, acc2);
    acc3 = square_add(grad, i + 3 * lanes, acc3);
  }
  for (; i + lanes <= end; i += lanes) acc0 = square_add(grad, i, acc0);
  if (i < end) {
    HWY_ALIGN GradElement<G> tail[kMaxFloatLanes] = {};  // zeros add nothing
    std::copy_n(grad + i, end - i, tail);
    acc1 = square_add(tail, 0, acc1);
  }
  HWY_ALIGN double partial[kMaxFloatLanes] = {};
  hn::Store(hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3)), dd, partial);
  double sum = 0.0;
  for (size_t k = 0; k < lanes; ++k) sum += partial[k];
  return sum;
}

}  // namespace

void MasterToModelChunk(const float* master, uint16_t* model, ModelFormat format, int64_t begin,
                        int64_t end) {
  dispatch_model_format(format, [&](auto m) {
    constexpr ModelFormat M = decltype(m)::value;
    // Only a separate BF16/FP16 model param is derived from the master alone.
    if constexpr (M == ModelFormat::kBF16 || M == ModelFormat::kF16) {
      MasterToModelRange<M>(master, model, static_cast<size_t>(begin), static_cast<size_t>(end));
    }
  });
}

void SplitMasterChunk(const float* HWY_RESTRICT master, uint16_t* HWY_RESTRICT param,
                      int16_t* HWY_RESTRICT remainder, int64_t begin, int64_t end_signed) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d), end = static_cast<size_t>(end_signed);
  size_t i = static_cast<size_t>(begin);
  for (; i + lanes <= end; i += lanes) {
    SplitMaster(d, hn::LoadU(d, master + i), param + i, remainder + i);
  }
  if (i == end) return;
  HWY_ALIGN float in[kMaxFloatLanes] = {};
  HWY_ALIGN uint16_t out_param[kMaxFloatLanes] = {};
  HWY_ALIGN int16_t out_remainder[kMaxFloatLanes] = {};
  std::copy_n(master + i, end - i, in);
  SplitMaster(d, hn::Load(d, in), out_param, out_remainder);
  std::copy_n(out_param, end - i, param + i);
  std::copy_n(out_remainder, end - i, remainder + i);
}

void JoinMasterChunk(const uint16_t* HWY_RESTRICT param, const int16_t* HWY_RESTRICT remainder,
                     float* HWY_RESTRICT master, int64_t begin, int64_t end_signed) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d), end = static_cast<size_t>(end_signed);
  size_t i = static_cast<size_t>(begin);
  for (; i + lanes <= end; i += lanes) {
    hn::StoreU(JoinMaster(d, param + i, remainder + i), d, master + i);
  }
  if (i == end) return;
  HWY_ALIGN uint16_t in_param[kMaxFloatLanes] = {};
  HWY_ALIGN int16_t in_remainder[kMaxFloatLanes] = {};
  HWY_ALIGN float out[kMaxFloatLanes] = {};
  std::copy_n(param + i, end - i, in_param);
  std::copy_n(remainder + i, end - i, in_remainder);
  hn::Store(JoinMaster(d, in_param, in_remainder), d, out);
  std::copy_n(out, end - i, master + i);
}

double SumOfSquaresChunk(const void* grad, GradFormat format, int64_t begin, int64_t end) {
  return dispatch_grad_format(format, [&](auto g) {
    return SumOfSquaresRange<g>(static_cast<const GradElement<g>*>(grad),
                                static_cast<size_t>(begin), static_cast<size_t>(end));
  });
}

// Names the target this instantiation was compiled for (test hook).
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace mixprec::optim::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mixprec::optim::detail {

HWY_EXPORT(MasterToModelChunk);
HWY_EXPORT(SplitMasterChunk);
HWY_EXPORT(JoinMasterChunk);
HWY_EXPORT(SumOfSquaresChunk);
HWY_EXPORT(TargetName);

void master_to_model_chunk(const float* master, uint16_t* model, ModelFormat format, int64_t begin,
                           int64_t end) {
  HWY_DYNAMIC_DISPATCH(MasterToModelChunk)(master, model, format, begin, end);
}

void split_master_chunk(const float* master, uint16_t* param, int16_t* remainder, int64_t begin,
                        int64_t end) {
  HWY_DYNAMIC_DISPATCH(SplitMasterChunk)(master, param, remainder, begin, end);
}

void join_master_chunk(const uint16_t* param, const int16_t* remainder, float* master,
                       int64_t begin, int64_t end) {
  HWY_DYNAMIC_DISPATCH(JoinMasterChunk)(param, remainder, master, begin, end);
}

double sum_of_squares_chunk(const void* grad, GradFormat format, int64_t begin, int64_t end) {
  return HWY_DYNAMIC_DISPATCH(SumOfSquaresChunk)(grad, format, begin, end);
}

std::string active_simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace mixprec::optim::detail
#endif  // HWY_ONCE
