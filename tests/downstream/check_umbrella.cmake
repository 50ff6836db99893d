# ctest install.umbrella_header_complete: <mixprec/mixprec.h> includes every public header.
#   cmake -DINCLUDE_DIR=<repo>/include -P check_umbrella.cmake
# Public: every .h under include/mixprec/ except detail/ (implementation details that public
# headers include themselves) and mixprec.h itself.
file(READ "${INCLUDE_DIR}/mixprec/mixprec.h" umbrella)
file(GLOB_RECURSE headers RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/mixprec/*.h")
set(missing "")
foreach(header IN LISTS headers)
  if(header MATCHES "^mixprec/detail/" OR header STREQUAL "mixprec/mixprec.h")
    continue()
  endif()
  string(FIND "${umbrella}" "#include \"${header}\"" at)
  if(at EQUAL -1)
    list(APPEND missing "${header}")
  endif()
endforeach()
if(missing)
  list(JOIN missing "\n  " text)
  message(FATAL_ERROR "include/mixprec/mixprec.h does not include:\n  ${text}")
endif()
list(LENGTH headers count)
message(STATUS "mixprec.h includes all ${count} public headers (detail/ excepted)")
