# Build settings for src/quant (included from src/CMakeLists.txt after optim/optim.cmake, which
# finds Highway and links it and the OpenMP runtime into the library targets).
#
# The fused fake-quantization kernel is compiled once per Highway target inside one translation
# unit, the best chosen at run time (HWY_DYNAMIC_DISPATCH), as the optimizer kernels are: no
# -march flag. It includes Highway and no LibTorch, so it skips the precompiled header.
# No -ffp-contract=off needed: its only floating-point operations are a division, a product and
# an exact add/subtract pair, none of which can fuse.
find_package(hwy CONFIG QUIET)
if(TARGET hwy::hwy)
  get_target_property(_mixprec_quant_hwy_defines hwy::hwy INTERFACE_COMPILE_DEFINITIONS)
  get_target_property(_mixprec_quant_hwy_includes hwy::hwy INTERFACE_INCLUDE_DIRECTORIES)
else()
  find_path(MIXPREC_HWY_INCLUDE_DIR hwy/highway.h REQUIRED)
  set(_mixprec_quant_hwy_defines HWY_SHARED_DEFINE)
  set(_mixprec_quant_hwy_includes ${MIXPREC_HWY_INCLUDE_DIR})
endif()
foreach(_var _mixprec_quant_hwy_defines _mixprec_quant_hwy_includes)
  if(NOT ${_var})
    set(${_var} "")
  endif()
endforeach()
# An explicit -isystem /usr/include would break libstdc++'s #include_next.
list(REMOVE_ITEM _mixprec_quant_hwy_includes ${CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES})
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/kernels/fake_quant_simd.cpp PROPERTIES
  COMPILE_DEFINITIONS "${_mixprec_quant_hwy_defines}"
  INCLUDE_DIRECTORIES "${_mixprec_quant_hwy_includes}"
  SKIP_PRECOMPILE_HEADERS ON)

# The dispatching file splits the work with at::parallel_for, which runs in parallel only in
# translation units compiled with OpenMP (see optim.cmake); it skips the precompiled header,
# built without the flag.
find_package(OpenMP COMPONENTS CXX)
if(OpenMP_CXX_FOUND)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/kernels/fake_quant_fused.cpp PROPERTIES
    COMPILE_OPTIONS "${OpenMP_CXX_FLAGS}"
    SKIP_PRECOMPILE_HEADERS ON)
endif()
