# Shared set-up for scripts/run-demo and scripts/run-tests. Sourced, not run.
# Every step checks before it acts, so running it twice does no work twice.
set -euo pipefail

MIXPREC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIXPREC_VENV="${MIXPREC_VENV:-$MIXPREC_ROOT/.venv}"
MIXPREC_BUILD="${MIXPREC_BUILD:-$MIXPREC_ROOT/build}"
MIXPREC_TORCH_VERSION="2.13.0"

log() { printf '[mixprec setup] %s\n' "$*" >&2; }

# Debian packages the build needs: compiler, CMake, Ninja, GoogleTest, Google Benchmark,
# and the libraries later layers use (JSON, SIMD dispatch, checksums, the gloo headers that
# LibTorch's ProcessGroupGloo.hpp includes but the wheel does not ship).
# clang and its libFuzzer runtime build the format layer's fuzz targets (fuzz/run-fuzz.sh);
# clang-format checks the style (scripts/check-format, ctest style.clang_format).
MIXPREC_DEBIAN_PACKAGES=(g++ cmake ninja-build python3-venv libgtest-dev libgmock-dev
  libbenchmark-dev nlohmann-json3-dev libhwy-dev libxxhash-dev clang libclang-rt-14-dev
  libgloo-dev clang-format)

ensure_debian_packages() {
  local missing=()
  for pkg in "${MIXPREC_DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$pkg")
  done
  # python3-venv is only needed when the system python lacks the venv module.
  if [[ " ${missing[*]-} " == *" python3-venv "* ]] && python3 -c 'import venv, ensurepip' 2>/dev/null; then
    missing=("${missing[@]/python3-venv/}")
  fi
  local real=()
  for pkg in "${missing[@]-}"; do [[ -n "$pkg" ]] && real+=("$pkg"); done
  ((${#real[@]} == 0)) && return 0
  if [[ $(id -u) -eq 0 ]]; then
    log "installing Debian packages: ${real[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${real[@]}" >/dev/null
  else
    log "missing Debian packages: ${real[*]}"
    log "install them with: sudo apt-get install -y ${real[*]}"
    exit 1
  fi
}

ensure_venv() {
  if [[ ! -x "$MIXPREC_VENV/bin/python" ]]; then
    log "creating virtual environment $MIXPREC_VENV"
    python3 -m venv "$MIXPREC_VENV"
  fi
  if ! "$MIXPREC_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$MIXPREC_TORCH_VERSION')" 2>/dev/null; then
    log "installing torch==$MIXPREC_TORCH_VERSION (LibTorch comes from its wheel)"
    "$MIXPREC_VENV/bin/pip" install -q "torch==$MIXPREC_TORCH_VERSION"
  fi
  # The tests use numpy-free PyTorch and safetensors as reference readers.
  if ! "$MIXPREC_VENV/bin/python" -c "import safetensors, numpy" 2>/dev/null; then
    log "installing safetensors and numpy (test oracles)"
    "$MIXPREC_VENV/bin/pip" install -q safetensors numpy
  fi
  # scripts/plot_metrics.py draws mixprec-train's loss curves.
  if ! "$MIXPREC_VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
    log "installing matplotlib (scripts/plot_metrics.py)"
    "$MIXPREC_VENV/bin/pip" install -q matplotlib
  fi
}

# Configures build folder $1 once (a folder with a CMakeCache is reused; extra CMake
# arguments follow), then builds it incrementally.
configure_and_build() {
  local dir="$1"
  shift
  if [[ ! -f "$dir/CMakeCache.txt" ]]; then
    local prefix
    prefix="$("$MIXPREC_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
    local launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    log "configuring $dir"
    cmake -S "$MIXPREC_ROOT" -B "$dir" -G Ninja \
      -DCMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH:+$CMAKE_PREFIX_PATH;}$prefix" \
      -DMIXPREC_PYTHON="$MIXPREC_VENV/bin/python" "${launcher[@]}" "$@" >/dev/null
  fi
  local start=$SECONDS
  cmake --build "$dir" --parallel "$(nproc)"
  log "build of $dir finished in $((SECONDS - start)) s"
}

build_project() {
  configure_and_build "$MIXPREC_BUILD" -DCMAKE_BUILD_TYPE=Release
}

# The second build: the whole unit-test suite under AddressSanitizer and
# UndefinedBehaviorSanitizer, linked with the same (uninstrumented) LibTorch from the wheel.
# -O1 keeps the build and the run fast while ASan still sees every access; no benchmarks,
# no demo, and no fuzz test (the normal build's ctest already runs it, under its own ASan).
# MIXPREC_SANITIZE=0 skips it.
MIXPREC_ASAN_BUILD="${MIXPREC_ASAN_BUILD:-$MIXPREC_ROOT/build-asan}"
MIXPREC_SANITIZE="${MIXPREC_SANITIZE:-1}"
MIXPREC_SANITIZER_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
# GCC at -O1 with ASan reports maybe-uninitialized falsely, mostly inside LibTorch headers.
MIXPREC_SANITIZER_WARNINGS="-Wno-maybe-uninitialized"

build_sanitized() {
  sanitizer_env  # the build runs the test binaries to list their tests
  configure_and_build "$MIXPREC_ASAN_BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DCMAKE_CXX_FLAGS="$MIXPREC_SANITIZER_FLAGS $MIXPREC_SANITIZER_WARNINGS" \
    -DCMAKE_EXE_LINKER_FLAGS="$MIXPREC_SANITIZER_FLAGS" \
    -DCMAKE_SHARED_LINKER_FLAGS="$MIXPREC_SANITIZER_FLAGS" \
    -DMIXPREC_BUILD_BENCH=OFF -DMIXPREC_BUILD_EXAMPLES=OFF -DMIXPREC_FUZZ_IN_TESTS=OFF \
    -DMIXPREC_SANITIZED_SUITE=ON
}

# Run-time options of the sanitized build (a caller's own ASAN_OPTIONS/UBSAN_OPTIONS win).
# LeakSanitizer is on: the suite leaks nothing, LibTorch's one-time allocations included.
sanitizer_env() {
  export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
}

setup_all() {
  ensure_debian_packages
  ensure_venv
  build_project
}
