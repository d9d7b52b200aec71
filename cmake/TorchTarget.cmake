# The imported INTERFACE target kernmap::torch_cpu: torch_cpu + c10 from a torch folder (the `torch` package
# folder of the PyPI wheel, or an unpacked LibTorch), their include folders, the C++ ABI and -fopenmp. The
# build includes this file (cmake/TorchCPU.cmake) and so does the installed package (kernmapConfig.cmake,
# installed as kernmapTorchTarget.cmake), so that kernmap and the projects using it compile and link alike.
#
# The wheel's ATen is built with OpenMP (AT_PARALLEL_OPENMP): at::parallel_for is a `#pragma omp parallel` in a
# header, so code calling it must be compiled with -fopenmp or it runs serially. At run time the process shares
# the one libgomp.so.1 that libtorch_cpu loads. ATen's headers need C++20 (ATen/ATen.h stops with an #error
# otherwise): the target requires it of whatever links it.

# Sets out_error to why dir is not a usable torch folder ("" when it is) and out_version to its version
# ("2.15.0", read from the headers).
function(kernmap_check_torch_dir dir out_error out_version)
  set(${out_version} "" PARENT_SCOPE)
  foreach(f lib/libtorch_cpu.so lib/libc10.so include/ATen/ATen.h include/torch/csrc/api/include/torch/version.h)
    if(NOT EXISTS "${dir}/${f}")
      set(${out_error} "${dir}/${f} does not exist" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  # torch >= 2.9 keeps the numbers in torch/headeronly/version.h; older ones in torch/csrc/api/include/torch/version.h.
  set(_version_h "${dir}/include/torch/headeronly/version.h")
  if(NOT EXISTS "${_version_h}")
    set(_version_h "${dir}/include/torch/csrc/api/include/torch/version.h")
  endif()
  set(_parts)
  foreach(part MAJOR MINOR PATCH)
    file(STRINGS "${_version_h}" _line REGEX "^#define TORCH_VERSION_${part} [0-9]+")
    if(NOT _line MATCHES "TORCH_VERSION_${part} ([0-9]+)")
      set(${out_error} "${_version_h} does not define TORCH_VERSION_${part}" PARENT_SCOPE)
      return()
    endif()
    list(APPEND _parts "${CMAKE_MATCH_1}")
  endforeach()
  list(JOIN _parts "." _version)
  set(${out_version} "${_version}" PARENT_SCOPE)
  set(${out_error} "" PARENT_SCOPE)
endfunction()

# Defines kernmap::torch_cpu for the torch folder dir, built with _GLIBCXX_USE_CXX11_ABI=cxx11_abi (0 or 1).
# Extra arguments are passed to add_library (GLOBAL in the build, so every subfolder sees it).
function(kernmap_add_torch_target dir cxx11_abi)
  if(TARGET kernmap::torch_cpu)
    return()
  endif()
  add_library(kernmap::torch_cpu INTERFACE IMPORTED ${ARGN})
  set_target_properties(kernmap::torch_cpu PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${dir}/include;${dir}/include/torch/csrc/api/include"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${dir}/include;${dir}/include/torch/csrc/api/include"
    INTERFACE_LINK_LIBRARIES "${dir}/lib/libtorch_cpu.so;${dir}/lib/libc10.so"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${cxx11_abi}"
    INTERFACE_COMPILE_OPTIONS "-fopenmp"
    INTERFACE_COMPILE_FEATURES "cxx_std_20"
    INTERFACE_LINK_OPTIONS "-fopenmp")
endfunction()
