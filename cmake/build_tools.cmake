# Compiler cache, linker and sanitizer settings for every target (included from the top-level
# CMakeLists.txt before any target exists).
#
# ccache (MIXPREC_CCACHE, on when ccache is found and no launcher was given): two clones of the
# same commit share hits. base_dir makes the paths under the repository relative, hash_dir=false
# keeps the build folder's path out of the hash, and the sloppiness settings are the ones the
# ccache manual asks for with precompiled headers (pch_defines, time_macros) plus header
# timestamps, which a fresh clone sets to the clone's time. The settings ride in the launcher
# command itself, so a plain `ninja` in the build folder uses them too. The cache folder is
# ccache's default (~/.cache/ccache), shared by every clone on the machine.
option(MIXPREC_CCACHE "Compile through ccache when it is installed" ON)
find_program(MIXPREC_CCACHE_PROGRAM ccache)
if(MIXPREC_CCACHE AND MIXPREC_CCACHE_PROGRAM AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(MIXPREC_CCACHE_LAUNCHER
      /usr/bin/env
      "CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}"
      CCACHE_NOHASHDIR=1
      "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
      ${MIXPREC_CCACHE_PROGRAM})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${MIXPREC_CCACHE_LAUNCHER})
  message(STATUS "mixprec: compiling through ${MIXPREC_CCACHE_PROGRAM}")
endif()

# mold links a test binary against LibTorch in a fraction of GNU ld's time.
include(CheckLinkerFlag)
check_linker_flag(CXX "-fuse-ld=mold" MIXPREC_HAVE_MOLD)
if(MIXPREC_HAVE_MOLD)
  add_link_options(-fuse-ld=mold)
endif()

# The sanitized pass (scripts/run-tests): what handles untrusted bytes and raw memory is compiled
# a second time with AddressSanitizer and UndefinedBehaviorSanitizer (src/CMakeLists.txt
# names the sources, tests/CMakeLists.txt the tests). Its targets are not part of `all`; the
# target `sanitized` builds them and `ctest -L sanitized` runs their tests.
option(MIXPREC_SANITIZED_TARGETS "Define the sanitized library and tests (target `sanitized`)" ON)
set(MIXPREC_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all
    -fno-omit-frame-pointer)
# -O1 keeps the instrumented code fast while ASan still sees every access. GCC at -O1 with ASan
# reports maybe-uninitialized falsely, mostly inside LibTorch headers.
set(MIXPREC_SANITIZED_COMPILE_OPTIONS ${MIXPREC_SANITIZER_FLAGS} -O1 -g1
    -Wno-maybe-uninitialized)
if(MIXPREC_SANITIZED_TARGETS)
  add_custom_target(sanitized)
endif()

# mixprec_reuse_pch(<target> <pch owner>): <target> compiles with <pch owner>'s precompiled
# header. GCC uses a PCH only when the macros defined on the command line are the same as when
# it was built (and the same -O level), and otherwise silently (-Winvalid-pch aside) compiles
# without it: 30 s a file instead of a few. So <target> also gets the owner's own definitions
# and options (the unity builds' MIXPREC_UNITY_ID, the tests' -Og and GTEST_HAS_PTHREAD).
function(mixprec_reuse_pch target owner)
  target_precompile_headers(${target} REUSE_FROM ${owner})
  target_compile_definitions(${target} PRIVATE $<TARGET_PROPERTY:${owner},COMPILE_DEFINITIONS>)
  target_compile_options(${target} PRIVATE $<TARGET_PROPERTY:${owner},COMPILE_OPTIONS>)
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR})  # <src/detail/pch.h>
endfunction()
