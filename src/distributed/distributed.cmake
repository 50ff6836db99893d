# Build settings for src/distributed (included from src/CMakeLists.txt).
#
# c10d from the LibTorch wheel. The wheel ships ProcessGroupGloo.hpp but not the gloo headers
# it includes; Debian's libgloo-dev provides them (headers only: gloo's code is the copy inside
# libtorch_cpu, nothing links libgloo). ProcessGroupGloo.hpp is active only with
# USE_C10D_GLOO, which is set on gloo_backend.cpp alone. That file skips the shared
# precompiled header: the PCH is reused by every test and tool target (REUSE_FROM), so a
# definition baked into it would have to match everywhere.
find_path(MIXPREC_GLOO_INCLUDE_DIR gloo/algorithm.h)
if(NOT MIXPREC_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "mixprec: gloo headers not found; install Debian's libgloo-dev "
                      "(scripts/common.sh lists it)")
endif()
set(_mixprec_gloo_includes ${MIXPREC_GLOO_INCLUDE_DIR})
list(REMOVE_ITEM _mixprec_gloo_includes ${CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES})
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/gloo_backend.cpp PROPERTIES
  COMPILE_DEFINITIONS "USE_C10D_GLOO"
  INCLUDE_DIRECTORIES "${_mixprec_gloo_includes}"
  SKIP_PRECOMPILE_HEADERS ON)

# ProcessGroupNCCL exists only in a CUDA LibTorch. Exactly one of nccl_backend.cpp and
# nccl_unavailable.cpp is compiled; the other is kept out of the build (the library globs
# every source).
# NCCL's header: first the pip nvidia-nccl package's beside the wheel's LibTorch (the NCCL
# that LibTorch was built with; ProcessGroupNCCL.hpp's inline code sizes NCCL's config struct
# from the header we compile with), then the toolkit's and the system's.
find_path(MIXPREC_NCCL_INCLUDE_DIR nccl.h
  HINTS ${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include ${TORCH_INSTALL_PREFIX}/include
        ${CUDAToolkit_INCLUDE_DIRS})
if(TORCH_CUDA_LIBRARIES AND MIXPREC_NCCL_INCLUDE_DIR)
  message(STATUS "mixprec: CUDA LibTorch found; building the NCCL backend")
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/nccl_backend.cpp PROPERTIES
    COMPILE_DEFINITIONS "USE_C10D_NCCL;USE_CUDA"
    INCLUDE_DIRECTORIES "${MIXPREC_NCCL_INCLUDE_DIR}"
    SKIP_PRECOMPILE_HEADERS ON)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/nccl_unavailable.cpp PROPERTIES
    HEADER_FILE_ONLY ON)
else()
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/nccl_backend.cpp PROPERTIES
    HEADER_FILE_ONLY ON)
endif()
