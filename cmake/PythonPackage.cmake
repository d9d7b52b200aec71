# The Python package, installed from this build into an environment's site-packages, so that libkernmap is
# compiled once for C++ and Python alike (scripts/setup):
#
#   cmake --install build/release --component python --prefix <site-packages>
#
# writes
#
#   kernmap/                       python/kernmap as it stands in the sources
#   kernmap/libkernmap.so          this build's library, RPATH $ORIGIN/../torch/lib (the torch wheel beside it)
#   kernmap-<version>.dist-info/   METADATA, INSTALLER, RECORD: pip lists, replaces and uninstalls it like any
#                                  installed distribution
#
# after removing what an earlier install of the package left there (by this script or by pip). The component
# is left out of a plain `cmake --install` (the CMake package, cmake/Package.cmake). The steps are
# cmake/InstallPythonPackage.cmake; this file hands it the build's facts.

# The distribution's name, version and summary are pyproject.toml's (`pip install .` builds a wheel from it).
file(READ "${CMAKE_SOURCE_DIR}/pyproject.toml" _pyproject)
foreach(field version description requires-python)
  if(NOT _pyproject MATCHES "\n${field} = \"([^\"]*)\"")
    message(FATAL_ERROR "kernmap: pyproject.toml has no ${field} = \"...\" line")
  endif()
  set(_py_${field} "${CMAKE_MATCH_1}")
endforeach()
if(NOT _py_version STREQUAL PROJECT_VERSION)
  message(FATAL_ERROR "kernmap: pyproject.toml's version ${_py_version} differs from the project's ${PROJECT_VERSION}")
endif()

install(CODE "
set(KERNMAP_PY_SOURCE \"${CMAKE_SOURCE_DIR}/python/kernmap\")
set(KERNMAP_PY_LIBRARY \"$<TARGET_FILE:kernmap>\")
set(KERNMAP_PY_VERSION \"${PROJECT_VERSION}\")
set(KERNMAP_PY_SUMMARY \"${_py_description}\")
set(KERNMAP_PY_REQUIRES_PYTHON \"${_py_requires-python}\")"
  COMPONENT python EXCLUDE_FROM_ALL)
install(SCRIPT "${CMAKE_SOURCE_DIR}/cmake/InstallPythonPackage.cmake" COMPONENT python EXCLUDE_FROM_ALL)
