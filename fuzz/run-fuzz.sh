#!/usr/bin/env bash
# Builds the checkpoint-format fuzz targets with clang (libFuzzer + ASan + UBSan) in their own
# build directory — no LibTorch needed — and runs each for a bounded time.
#
#   fuzz/run-fuzz.sh [SECONDS_PER_TARGET]      build, then run (default 30 s per target)
#   fuzz/run-fuzz.sh --build-only              build only (the target `sanitized` does this)
#   fuzz/run-fuzz.sh --run-only SECONDS        run what was built (ctest asan.fuzz.format_parsers)
#
# Environment: MIXPREC_FUZZ_BUILD_DIR (default <repo>/build-fuzz), CXX (default clang++),
# MIXPREC_FUZZ_LAUNCHER (a compiler launcher such as ccache, its words joined by '|').
# Exit status: 0 if every target ran its time without a finding; 1 if any crashed, leaked,
# timed out or tripped a sanitizer (the reproducer is under <build>/artifacts/); 2 on setup
# errors. As root, installs clang and the libFuzzer runtime with apt-get when they are missing.
set -euo pipefail

build=1 run=1
case "${1-}" in
  --build-only) run=0; shift ;;
  --run-only) build=0; shift ;;
esac
seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: $0 [--build-only | --run-only] [seconds-per-target > 0]" >&2
  exit 2
fi
fuzz_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(dirname "$fuzz_dir")"
build_dir="${MIXPREC_FUZZ_BUILD_DIR:-$repo_dir/build-fuzz}"
cxx="${CXX:-clang++}"
targets=(fuzz_safetensors_header fuzz_manifest)

# Can $cxx link a libFuzzer binary? (clang without libclang-rt-*-dev cannot.)
can_build_fuzzer() {
  command -v "$cxx" >/dev/null 2>&1 || return 1
  local probe
  probe="$(mktemp -d)"
  printf '%s\n' '#include <cstdint>' '#include <cstddef>' \
    'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' \
    > "$probe/probe.cpp"
  local ok=0
  "$cxx" -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" \
    >/dev/null 2>&1 || ok=1
  rm -rf "$probe"
  return $ok
}

build_fuzzers() {
  if ! can_build_fuzzer; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "error: '$cxx' cannot build libFuzzer targets; install clang and its libFuzzer" \
           "runtime (Debian 12: apt-get install clang libclang-rt-14-dev)" >&2
      exit 2
    fi
    echo "== installing clang and the libFuzzer runtime"
    export DEBIAN_FRONTEND=noninteractive
    # The runtime package is named after clang's major version; ask the installed (or
    # candidate) clang which one that is.
    install() { apt-get install -y -q --no-install-recommends "$@"; }
    install clang || { apt-get update -q && install clang; }
    major="$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1)"
    install "libclang-rt-${major}-dev" || install "libclang-common-${major}-dev"
    cxx=clang++
    can_build_fuzzer || { echo "error: clang still cannot build libFuzzer targets" >&2; exit 2; }
  fi

  generator=()
  if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
  if [ -f "$build_dir/CMakeCache.txt" ] && ! grep -q "CMAKE_HOME_DIRECTORY:INTERNAL=$fuzz_dir\$" \
       "$build_dir/CMakeCache.txt"; then
    echo "error: $build_dir holds a different CMake project; set MIXPREC_FUZZ_BUILD_DIR" >&2
    exit 2
  fi
  local launcher=()
  if [ -n "${MIXPREC_FUZZ_LAUNCHER-}" ]; then
    launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=${MIXPREC_FUZZ_LAUNCHER//|/;}")
  fi
  echo "== configuring $build_dir"
  cmake -S "$fuzz_dir" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER="$cxx" "${launcher[@]}" >/dev/null
  echo "== building ${targets[*]}"
  cmake --build "$build_dir" --target "${targets[@]}" -- -j"${MIXPREC_FUZZ_JOBS:-2}"
}

if ((build)); then build_fuzzers; fi
if ((!run)); then exit 0; fi
for target in "${targets[@]}"; do
  if [ ! -x "$build_dir/$target" ]; then
    echo "error: $build_dir/$target is not built (run $0 --build-only first)" >&2
    exit 2
  fi
done

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
mkdir -p "$build_dir/artifacts"
failed=()
for target in "${targets[@]}"; do
  seeds="$fuzz_dir/corpus/${target#fuzz_}"
  corpus="$build_dir/corpus/${target#fuzz_}"  # grows across runs; the checked-in seeds do not
  mkdir -p "$corpus"
  echo "== $target for ${seconds}s"
  if "$build_dir/$target" "$corpus" "$seeds" -max_total_time="$seconds" -timeout=10 \
       -rss_limit_mb=2048 -max_len=16384 -dict="$fuzz_dir/json.dict" -print_final_stats=1 \
       -artifact_prefix="$build_dir/artifacts/$target-" 2>"$build_dir/$target.log"; then
    grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb)|cov:" "$build_dir/$target.log" \
      | tail -n 3 || true
  else
    echo "!! $target found a problem; log: $build_dir/$target.log" >&2
    tail -n 40 "$build_dir/$target.log" >&2
    failed+=("$target")
  fi
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "FAILED: ${failed[*]} (reproducers in $build_dir/artifacts/)" >&2
  exit 1
fi
echo "OK: ${#targets[@]} fuzz targets ran ${seconds}s each without findings"
