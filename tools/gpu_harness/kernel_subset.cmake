# SPDX-License-Identifier: Apache-2.0
# Loaded by tools/gpu_harness/kernels.py through CMAKE_PROJECT_INCLUDE, so that
# vLLM 0.16.0's own CMakeLists.txt (unmodified) configures every target with
# its own flags, and only the sources the DeepSeek-family EAGLE-3 paths reach
# are compiled. It runs after every project() call; the first one defers the
# edit to the end of the top directory, when every target exists and before
# CMake generates.
#
# Inputs (cache variables set by kernels.py):
#   EAGLE3_KERNEL_TARGETS        the targets to trim, e.g. _C;_moe_C
#   EAGLE3_KERNEL_SRCS_<target>  path suffixes of the sources to keep
#   EAGLE3_KERNEL_SWAP_<target>  "original-suffix=replacement-path" (bindings)
#   EAGLE3_KERNEL_PLACEHOLDER    an empty C++ file for targets that are not built
#   EAGLE3_KERNEL_FIRST          targets whose objects ninja should start first, the most urgent first
# Output: for each EAGLE3_KERNEL_FIRST target, eagle3_first_<target>, which builds it.
include_guard(GLOBAL)

function(_eagle3_trim_target tgt)
  get_target_property(srcs ${tgt} SOURCES)
  set(kept "")
  foreach(want IN LISTS EAGLE3_KERNEL_SRCS_${tgt})
    set(found "")
    foreach(s IN LISTS srcs)
      string(LENGTH "${s}" ls)
      string(LENGTH "${want}" lw)
      if(ls GREATER_EQUAL lw)
        math(EXPR off "${ls} - ${lw}")
        string(SUBSTRING "${s}" ${off} -1 tail)
        if(tail STREQUAL want)
          set(found "${s}")
          break()
        endif()
      endif()
    endforeach()
    if(found STREQUAL "")
      message(FATAL_ERROR "eagle3 kernel subset: ${tgt} has no source ending in ${want}; "
                          "the pinned CMakeLists.txt no longer lists it (update kernels.py)")
    endif()
    foreach(swap IN LISTS EAGLE3_KERNEL_SWAP_${tgt})
      string(REPLACE "=" ";" pair "${swap}")
      list(GET pair 0 from)
      list(GET pair 1 to)
      if(want STREQUAL from)
        set(found "${to}")
      endif()
    endforeach()
    list(APPEND kept "${found}")
  endforeach()
  set_property(TARGET ${tgt} PROPERTY SOURCES "${kept}")
  # vLLM sets ENABLE_<kernel family> for the whole target when it adds a
  # family's sources; the entry files (scaled_mm_entry.cu and siblings) then
  # call into them. None of those families is built here, so the entries
  # compile as upstream's own "not compiled for this device" fallbacks.
  get_target_property(opts ${tgt} COMPILE_OPTIONS)
  if(opts)
    string(REGEX REPLACE ";-DENABLE_[A-Za-z0-9_]+=1" "" opts "${opts}")
    set_property(TARGET ${tgt} PROPERTY COMPILE_OPTIONS "${opts}")
  endif()
  list(LENGTH kept n)
  message(STATUS "eagle3 kernel subset: ${tgt} keeps ${n} sources")
endfunction()

function(_eagle3_apply_subset)
  foreach(tgt IN LISTS EAGLE3_KERNEL_TARGETS)
    if(NOT TARGET ${tgt})
      message(FATAL_ERROR "eagle3 kernel subset: vLLM's CMake defined no target ${tgt}")
    endif()
    _eagle3_trim_target(${tgt})
  endforeach()
  # Targets outside the subset are never built, but CMake checks their sources
  # exist when it generates; FlashMLA's sources are not staged (no registry release).
  get_property(all DIRECTORY "${CMAKE_SOURCE_DIR}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(tgt IN LISTS all)
    list(FIND EAGLE3_KERNEL_TARGETS ${tgt} i)
    get_target_property(type ${tgt} TYPE)
    if(i EQUAL -1 AND type STREQUAL "MODULE_LIBRARY")
      set_property(TARGET ${tgt} PROPERTY SOURCES "${EAGLE3_KERNEL_PLACEHOLDER}")
      set_property(TARGET ${tgt} PROPERTY EXCLUDE_FROM_ALL TRUE)
    endif()
  endforeach()
  _eagle3_order_first()
endfunction()

# ninja 1.12+ starts ready steps in order of the number of steps left after
# them on the way to what was asked for, then in build.ninja's order. Every
# object is one link away from its library, so ninja starts the objects of the
# target vLLM defines first (_C, about a minute each) and leaves Marlin MoE's
# object (4.5 min) to the end, which then decides the build's wall time. A
# chain of touch steps
# after a library, in a target of its own (eagle3_first_<target>, which
# kernels.py asks ninja for), adds that many steps after each of its objects:
# the first target listed gets the longest chain, so its objects start first.
# One utility target per chain: CMake makes every step of a utility target
# wait (order-only) for all the targets it depends on, which would lengthen
# the others' paths as much.
function(_eagle3_order_first)
  list(LENGTH EAGLE3_KERNEL_FIRST n)
  foreach(tgt IN LISTS EAGLE3_KERNEL_FIRST)
    set(prev ${tgt})
    foreach(k RANGE 1 ${n})
      set(stamp "${CMAKE_BINARY_DIR}/eagle3_first/${tgt}.${k}")
      add_custom_command(OUTPUT "${stamp}" COMMAND "${CMAKE_COMMAND}" -E touch "${stamp}"
                         DEPENDS ${prev} VERBATIM)
      set(prev "${stamp}")
    endforeach()
    add_custom_target(eagle3_first_${tgt} DEPENDS "${prev}")
    math(EXPR n "${n} - 1")
  endforeach()
endfunction()

cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _eagle3_apply_subset)
