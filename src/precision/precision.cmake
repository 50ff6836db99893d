# Build settings for src/precision (included from src/CMakeLists.txt after optim/optim.cmake,
# which finds Highway, sets _mixprec_hwy_defines/_mixprec_hwy_includes and links Highway and the
# OpenMP runtime into the library targets).
#
# The cross-entropy kernel is compiled once per Highway target inside one translation unit, the
# best chosen at run time, as the optimizer kernels are: no -march flag. It includes Highway and
# no LibTorch, so it skips the precompiled header; foreach_target.h includes the file itself
# once per target, so it is never part of a unity batch.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/kernels/cross_entropy_simd.cpp PROPERTIES
  COMPILE_DEFINITIONS "${_mixprec_hwy_defines}"
  INCLUDE_DIRECTORIES "${_mixprec_hwy_includes}"
  SKIP_PRECOMPILE_HEADERS ON
  SKIP_UNITY_BUILD_INCLUSION ON)
# cross_entropy.cpp splits rows with at::parallel_for, parallel only where compiled with OpenMP
# (optim.cmake); it skips the precompiled header, built without the flag.
if(OpenMP_CXX_FOUND)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/cross_entropy.cpp PROPERTIES
    COMPILE_OPTIONS "${OpenMP_CXX_FLAGS}"
    SKIP_PRECOMPILE_HEADERS ON)
endif()
