# Locates LibTorch inside the pinned PyPI torch wheel and defines the imported target kernmap::torch_cpu
# (cmake/TorchTarget.cmake: torch_cpu + c10, their include folders, the wheel's C++ ABI). The wheel's own
# TorchConfig.cmake looks for a CUDA toolkit of the version torch was built with; CPU targets do not need it, so
# it is not used here. Under pip (scikit-build-core) the interpreter that runs the build is the one whose torch
# to use.
if(DEFINED Python_EXECUTABLE)
  set(_kernmap_default_python "${Python_EXECUTABLE}")
else()
  set(_kernmap_default_python "python3")
endif()
set(KERNMAP_PYTHON "${_kernmap_default_python}" CACHE FILEPATH "Python interpreter of the environment that holds torch")
execute_process(
  COMMAND "${KERNMAP_PYTHON}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch.compiled_with_cxx11_abi())); print(torch.__version__)"
  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _torch_rc)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "kernmap: cannot import torch with KERNMAP_PYTHON=${KERNMAP_PYTHON}; run scripts/setup "
    "(with pip: `pip install --no-build-isolation .` in an environment that has torch)")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 KERNMAP_TORCH_DIR)
list(GET _torch_info 1 KERNMAP_TORCH_CXX11_ABI)
list(GET _torch_info 2 KERNMAP_TORCH_VERSION)
message(STATUS "kernmap: torch ${KERNMAP_TORCH_VERSION} at ${KERNMAP_TORCH_DIR}")

include("${CMAKE_CURRENT_LIST_DIR}/TorchTarget.cmake")
kernmap_check_torch_dir("${KERNMAP_TORCH_DIR}" _torch_error KERNMAP_TORCH_HEADER_VERSION)
if(_torch_error)
  message(FATAL_ERROR "kernmap: the torch of KERNMAP_PYTHON=${KERNMAP_PYTHON} has no LibTorch files: ${_torch_error}")
endif()
set(KERNMAP_TORCH_LIB_DIR "${KERNMAP_TORCH_DIR}/lib")
kernmap_add_torch_target("${KERNMAP_TORCH_DIR}" "${KERNMAP_TORCH_CXX11_ABI}" GLOBAL)
