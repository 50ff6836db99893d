# Shared set-up for scripts/run-demo and scripts/run-tests. Sourced, not run.
# Every step checks before it acts, so running it twice does no work twice.
set -euo pipefail

MIXPREC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIXPREC_VENV="${MIXPREC_VENV:-$MIXPREC_ROOT/.venv}"
MIXPREC_BUILD="${MIXPREC_BUILD:-$MIXPREC_ROOT/build}"
MIXPREC_TORCH_VERSION="2.13.0"
# In the venv once its bytecode is compiled (compile_bytecode).
MIXPREC_BYTECODE_MARKER=".mixprec-bytecode-compiled"

log() { printf '[mixprec setup] %s\n' "$*" >&2; }

# Debian packages the build needs: compiler, CMake, Ninja, GoogleTest, Google Benchmark,
# and the libraries later layers use (JSON, SIMD dispatch, checksums, the gloo headers that
# LibTorch's ProcessGroupGloo.hpp includes but the wheel does not ship).
# clang and its libFuzzer runtime build the format layer's fuzz targets (fuzz/run-fuzz.sh);
# clang-format checks the style (scripts/check-format, ctest style.clang_format); ccache lets
# a second build, or another clone, reuse compiled objects; mold links in a fraction of the time.
MIXPREC_DEBIAN_PACKAGES=(g++ cmake ninja-build python3-venv libgtest-dev libgmock-dev
  libbenchmark-dev nlohmann-json3-dev libhwy-dev libxxhash-dev clang libclang-rt-14-dev
  libgloo-dev clang-format ccache mold)

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
  # Whatever is installed below comes without bytecode; compile_bytecode does it afterwards.
  local installing=0
  if [[ ! -x "$MIXPREC_VENV/bin/python" ]]; then
    log "creating virtual environment $MIXPREC_VENV"
    python3 -m venv "$MIXPREC_VENV"
  fi
  # The version, and a CPU build: a CUDA one (an older set-up took PyPI's) is replaced.
  if ! "$MIXPREC_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$MIXPREC_TORCH_VERSION' or torch.version.cuda is not None)" 2>/dev/null; then
    # The CPU build: on PyPI, Linux torch wheels are CUDA builds, against which CMake refuses to
    # configure without a CUDA toolkit. A local wheel or index (pip's find-links) that has the
    # +cpu build is used as it is; otherwise PyTorch's own CPU index supplies it.
    log "installing torch==$MIXPREC_TORCH_VERSION+cpu (LibTorch comes from its wheel)"
    local first_try
    first_try=$(mktemp)
    if ! "$MIXPREC_VENV/bin/pip" install -q --no-compile "torch==$MIXPREC_TORCH_VERSION+cpu" \
      2>"$first_try"; then
      log "pip's own sources have no torch==$MIXPREC_TORCH_VERSION+cpu; trying PyTorch's CPU index"
      if ! "$MIXPREC_VENV/bin/pip" install -q --no-compile "torch==$MIXPREC_TORCH_VERSION+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu; then
        log "the first attempt said:"
        cat "$first_try" >&2
        rm -f "$first_try"
        exit 1
      fi
    fi
    rm -f "$first_try"
    installing=1
  fi
  # The tests use numpy-free PyTorch and safetensors as reference readers.
  if ! "$MIXPREC_VENV/bin/python" -c "import safetensors, numpy" 2>/dev/null; then
    log "installing safetensors and numpy (test oracles)"
    "$MIXPREC_VENV/bin/pip" install -q --no-compile safetensors numpy
    installing=1
  fi
  # scripts/plot_metrics.py draws mixprec-train's loss curves.
  if ! "$MIXPREC_VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
    log "installing matplotlib (scripts/plot_metrics.py)"
    "$MIXPREC_VENV/bin/pip" install -q --no-compile matplotlib
    installing=1
  fi
  ((installing == 0)) || rm -f "$MIXPREC_VENV/$MIXPREC_BYTECODE_MARKER"
}

# pip installs with --no-compile: byte-compiling torch's ~7000 modules took 19 of set-up's 35 s,
# all of it serial. compile_bytecode does it instead, beside the build (build_project), once per
# venv. It must happen before the tests: with PYTHONDONTWRITEBYTECODE set (as on CI machines)
# nothing would ever write the bytecode, and every Python start would parse torch again (+2 s).
compile_bytecode() {
  local marker="$MIXPREC_VENV/$MIXPREC_BYTECODE_MARKER"
  [[ -f "$marker" ]] && return 0
  local site
  site="$("$MIXPREC_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # Some packages ship sources for other Python versions (templates, tests): compileall reports
  # them and goes on, as pip does; only the marker depends on it having run.
  "$MIXPREC_VENV/bin/python" -m compileall -q -j1 "$site" >/dev/null 2>&1 || true
  touch "$marker"
}

# Configures the build folder once (a folder with a CMakeCache is reused; extra CMake arguments
# follow), then builds the given target incrementally (default: all).
configure_build() {
  if [[ ! -f "$MIXPREC_BUILD/CMakeCache.txt" ]]; then
    local prefix
    prefix="$("$MIXPREC_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
    log "configuring $MIXPREC_BUILD"
    cmake -S "$MIXPREC_ROOT" -B "$MIXPREC_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH:+$CMAKE_PREFIX_PATH;}$prefix" \
      -DMIXPREC_PYTHON="$MIXPREC_VENV/bin/python" -DMIXPREC_REQUIRE_ORACLE=ON "$@" >/dev/null
  fi
}

build_target() {
  configure_build
  cmake --build "$MIXPREC_BUILD" --parallel "$(nproc)" ${1:+--target "$1"}
}

build_project() {
  compile_bytecode &
  local bytecode=$! status=0
  # A failed build still waits for the bytecode: nothing is left writing into the venv.
  build_target || status=$?
  wait "$bytecode" || true
  return $status
}

# The sanitized pass (cmake/build_tools.cmake): what handles untrusted bytes and raw memory,
# compiled again with AddressSanitizer + UndefinedBehaviorSanitizer and linked with the normal
# build's other objects, its tests, and the format layer's fuzzers. MIXPREC_SANITIZE=0 skips it.
MIXPREC_SANITIZE="${MIXPREC_SANITIZE:-1}"
build_sanitized() {
  sanitizer_env  # the build runs the test binaries to list their tests
  build_target sanitized
}

# Run-time options of the sanitized build (a caller's own ASAN_OPTIONS/UBSAN_OPTIONS win).
# LeakSanitizer is on: the suite leaks nothing, LibTorch's one-time allocations included.
sanitizer_env() {
  export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
}

# Phase timing: `phase NAME COMMAND...` runs COMMAND, records how long it took, and returns its
# status; print_phases prints one line per phase (scripts/run-tests ends with them).
MIXPREC_PHASES=()
phase() {
  local name="$1" start=$SECONDS status=0
  shift
  # A subshell outside any `||`, so that `set -e` holds inside COMMAND.
  set +e
  (set -e; "$@")
  status=$?
  set -e
  MIXPREC_PHASES+=("$(printf '%-16s %5d s%s' "$name" $((SECONDS - start)) \
    "$( ((status == 0)) || echo "  (failed: exit $status)")")")
  return $status
}
print_phases() {
  local line
  echo "== phase times"
  for line in "${MIXPREC_PHASES[@]}"; do
    echo "   $line"
  done
  printf '   %-16s %5d s\n' total "$SECONDS"
}

set_up() {
  ensure_debian_packages
  ensure_venv
}

setup_all() {
  set_up
  build_project
}
