# Build settings for src/optim (included from src/CMakeLists.txt, where the library targets
# MIXPREC_LIBRARY_TARGETS exist).
#
# The fused optimizer kernels use Google Highway for SIMD. Every *_simd.cpp is compiled once
# per Highway target (SSSE3 ... AVX-512) inside one translation unit and the best one for the
# running CPU is picked at run time (HWY_DYNAMIC_DISPATCH): no -march flag here or anywhere.

find_package(hwy CONFIG QUIET)
if(TARGET hwy::hwy)
  set(_mixprec_hwy_library hwy::hwy)
  get_target_property(_mixprec_hwy_defines hwy::hwy INTERFACE_COMPILE_DEFINITIONS)
  get_target_property(_mixprec_hwy_includes hwy::hwy INTERFACE_INCLUDE_DIRECTORIES)
else()
  # Highway installed without its CMake package: the plain library and headers.
  find_library(MIXPREC_HWY_LIBRARY NAMES hwy REQUIRED)
  find_path(MIXPREC_HWY_INCLUDE_DIR hwy/highway.h REQUIRED)
  set(_mixprec_hwy_library ${MIXPREC_HWY_LIBRARY})
  set(_mixprec_hwy_defines HWY_SHARED_DEFINE)
  set(_mixprec_hwy_includes ${MIXPREC_HWY_INCLUDE_DIR})
endif()
# An explicit -isystem /usr/include would break libstdc++'s #include_next: keep only
# non-default header locations.
foreach(_var _mixprec_hwy_defines _mixprec_hwy_includes)
  if(NOT ${_var})
    set(${_var} "")
  endif()
endforeach()
list(REMOVE_ITEM _mixprec_hwy_includes ${CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES})
# LINK_ONLY: Highway's usage requirements (HWY_SHARED_DEFINE) must not reach the rest of the
# library, or they would be baked into the precompiled LibTorch header that tests and tools
# reuse (REUSE_FROM mixprec_objects), which GCC then rejects for lacking the same definition.
foreach(_target IN LISTS MIXPREC_LIBRARY_TARGETS)
  target_link_libraries(${_target} PRIVATE $<LINK_ONLY:${_mixprec_hwy_library}>)
endforeach()
# For the installed package (cmake/install.cmake): find_dependency(hwy) when it came as one.
if(TARGET hwy::hwy)
  set_target_properties(mixprec PROPERTIES MIXPREC_HWY_FROM_PACKAGE ON)
endif()

file(GLOB _mixprec_hwy_sources CONFIGURE_DEPENDS
     ${CMAKE_CURRENT_LIST_DIR}/kernels/*_simd.cpp
     ${CMAKE_CURRENT_LIST_DIR}/kernels/simd_targets.cpp)
# -ffp-contract=off: the kernels reproduce at::_fused_adam(w)_/_fused_sgd_ bit for bit, so
# every fused multiply-add must be one written in the source (hn::MulAdd), never one the
# compiler invents. These files include Highway and no LibTorch front end: they skip the
# precompiled header, whose flags and definitions differ from theirs anyway.
set_source_files_properties(${_mixprec_hwy_sources} PROPERTIES
  COMPILE_OPTIONS "-ffp-contract=off"
  COMPILE_DEFINITIONS "${_mixprec_hwy_defines}"
  INCLUDE_DIRECTORIES "${_mixprec_hwy_includes}"
  SKIP_PRECOMPILE_HEADERS ON)

# at::parallel_for is an inline template that runs in parallel only in translation units
# compiled with OpenMP, and LibTorch's CMake package does not pass -fopenmp on: without this
# the kernels would silently run on one thread. Only the dispatching files (those that include
# kernels/parallel_chunks.h) need the flag; they skip the shared precompiled header, built
# without it. The OpenMP runtime linked is the
# libgomp.so.1 LibTorch ships when there is one: a process must load only one libgomp.
find_package(OpenMP COMPONENTS CXX)
find_library(MIXPREC_TORCH_GOMP NAMES libgomp.so.1 PATHS "${TORCH_INSTALL_PREFIX}/lib"
             NO_DEFAULT_PATH)
if(OpenMP_CXX_FOUND)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/fused_kernels.cpp
                              ${CMAKE_CURRENT_LIST_DIR}/master_remainder.cpp PROPERTIES
    COMPILE_OPTIONS "${OpenMP_CXX_FLAGS}"
    SKIP_PRECOMPILE_HEADERS ON)
  if(MIXPREC_TORCH_GOMP)
    set(_mixprec_openmp_runtime ${MIXPREC_TORCH_GOMP})
  else()
    set(_mixprec_openmp_runtime OpenMP::OpenMP_CXX)
  endif()
  # Installed, a static libmixprec names the runtime mixprec::openmp_runtime, which
  # mixprecConfig.cmake finds again the same way on the consumer's machine (never a path
  # into this machine's LibTorch).
  foreach(_target IN LISTS MIXPREC_LIBRARY_TARGETS)
    target_link_libraries(${_target} PRIVATE
      $<LINK_ONLY:$<BUILD_INTERFACE:${_mixprec_openmp_runtime}>>
      $<LINK_ONLY:$<INSTALL_INTERFACE:mixprec::openmp_runtime>>)
  endforeach()
  set_target_properties(mixprec PROPERTIES MIXPREC_USES_OPENMP ON)
else()
  message(WARNING "mixprec: OpenMP not found; the fused optimizer kernels will use one thread")
endif()

# The offloading pipeline's CUDA copy engine (pinned staging, side streams) exists only in a
# build against a CUDA LibTorch; exactly one of device_copier_cuda.cpp and
# device_copier_no_cuda.cpp is compiled (the library globs every source).
if(TORCH_CUDA_LIBRARIES)
  message(STATUS "mixprec: CUDA LibTorch found; building the CUDA offload copy engine")
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/offload/device_copier_no_cuda.cpp
                              PROPERTIES HEADER_FILE_ONLY ON)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/offload/device_copier_cuda.cpp
                              PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
else()
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/offload/device_copier_cuda.cpp
                              PROPERTIES HEADER_FILE_ONLY ON)
endif()
