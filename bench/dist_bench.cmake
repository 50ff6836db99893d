# bench_dist and bench_dist_checkpoint launch themselves under torchrun (bench/dist_bench.cpp,
# bench/dist_checkpoint_bench.cpp): they need torchrun's path, beside the python that has torch
# (tests/distributed/distributed.cmake caches the same path).
if(TARGET bench_dist)
  if(NOT MIXPREC_TORCHRUN AND MIXPREC_PYTHON)
    get_filename_component(_mixprec_python_bin "${MIXPREC_PYTHON}" DIRECTORY)
    set(MIXPREC_TORCHRUN "${_mixprec_python_bin}/torchrun")
  endif()
  if(MIXPREC_TORCHRUN AND EXISTS "${MIXPREC_TORCHRUN}")
    target_compile_definitions(bench_dist PRIVATE MIXPREC_TORCHRUN="${MIXPREC_TORCHRUN}")
    if(TARGET bench_dist_checkpoint)
      target_compile_definitions(bench_dist_checkpoint PRIVATE
        MIXPREC_TORCHRUN="${MIXPREC_TORCHRUN}")
    endif()
  endif()
endif()
