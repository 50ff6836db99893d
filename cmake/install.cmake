# `cmake --install`: headers, the libraries (static, or shared with BUILD_SHARED_LIBS=ON),
# mixprec-ckpt, the Python checkpoint reader, and a CMake package so that consumers write
#   find_package(mixprec REQUIRED)
#   target_link_libraries(app PRIVATE mixprec::mixprec)
# Included from the top-level CMakeLists.txt once the targets exist.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(_mixprec_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/mixprec)
set_target_properties(mixprec PROPERTIES EXPORT_NAME mixprec)
set_target_properties(mixprec_format PROPERTIES EXPORT_NAME format)
set_target_properties(mixprec-ckpt PROPERTIES EXPORT_NAME mixprec-ckpt)

install(TARGETS mixprec mixprec_format mixprec-ckpt
  EXPORT mixprecTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/mixprec
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_SOURCE_DIR}/python/mixprec_reader.py
  DESTINATION ${CMAKE_INSTALL_DATADIR}/mixprec/python)
install(EXPORT mixprecTargets
  NAMESPACE mixprec::
  DESTINATION ${_mixprec_cmake_dir})

# What mixprecConfig.cmake needs to find the same dependencies again (see its header).
get_target_property(MIXPREC_LIBRARY_TYPE mixprec TYPE)
set(MIXPREC_TORCH_DIR_HINT "${Torch_DIR}")
# src/optim/optim.cmake records on the target how it found Highway and OpenMP (imported
# targets and variables of find_package are local to src/).
get_target_property(MIXPREC_HWY_FROM_PACKAGE mixprec MIXPREC_HWY_FROM_PACKAGE)
get_target_property(MIXPREC_USES_OPENMP mixprec MIXPREC_USES_OPENMP)
foreach(_var MIXPREC_HWY_FROM_PACKAGE MIXPREC_USES_OPENMP)
  if(NOT ${_var})
    set(${_var} OFF)
  endif()
endforeach()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/mixprecConfig.cmake.in
  ${PROJECT_BINARY_DIR}/mixprecConfig.cmake
  INSTALL_DESTINATION ${_mixprec_cmake_dir})
# 0.x: a new minor version may change the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/mixprecConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/mixprecConfig.cmake
              ${PROJECT_BINARY_DIR}/mixprecConfigVersion.cmake
  DESTINATION ${_mixprec_cmake_dir})
