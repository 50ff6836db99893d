// Applies a tensor function to every tensor inside a value: a tensor, a std::vector, a
// std::tuple, a std::pair or a std::optional of those, nested arbitrarily. Other values pass
// through unchanged. Used by Float16Module on inputs and outputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace mixprec::detail {

template <typename T, typename F>
T map_tensors(T value, const F& fn);

template <typename T>
struct TensorMapper {
  template <typename F>
  static T apply(T value, const F&) {
    return value;
  }
};

template <>
struct TensorMapper<at::Tensor> {
  template <typename F>
  static at::Tensor apply(at::Tensor value, const F& fn) {
    return fn(value);
  }
};

template <typename T, typename A>
struct TensorMapper<std::vector<T, A>> {
  template <typename F>
  static std::vector<T, A> apply(std::vector<T, A> value, const F& fn) {
    for (auto& item : value) item = map_tensors(std::move(item), fn);
    return value;
  }
};

template <typename... Ts>
struct TensorMapper<std::tuple<Ts...>> {
  template <typename F>
  static std::tuple<Ts...> apply(std::tuple<Ts...> value, const F& fn) {
    return std::apply(
        [&](auto&&... items) { return std::tuple<Ts...>(map_tensors(std::move(items), fn)...); },
        std::move(value));
  }
};

template <typename A, typename B>
struct TensorMapper<std::pair<A, B>> {
  template <typename F>
  static std::pair<A, B> apply(std::pair<A, B> value, const F& fn) {
    return {map_tensors(std::move(value.first), fn), map_tensors(std::move(value.second), fn)};
  }
};

template <typename T>
struct TensorMapper<std::optional<T>> {
  template <typename F>
  static std::optional<T> apply(std::optional<T> value, const F& fn) {
    if (value) value = map_tensors(std::move(*value), fn);
    return value;
  }
};

template <typename T, typename F>
T map_tensors(T value, const F& fn) {
  return TensorMapper<T>::apply(std::move(value), fn);
}

}  // namespace mixprec::detail
