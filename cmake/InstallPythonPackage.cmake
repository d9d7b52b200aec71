# Install-time steps of the "python" component (cmake/PythonPackage.cmake sets the KERNMAP_PY_* variables):
# the package and the build's library into CMAKE_INSTALL_PREFIX (a site-packages folder), then the
# dist-info that makes it an installed distribution for pip and importlib.metadata.
set(_site "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}")
set(_dist_info "kernmap-${KERNMAP_PY_VERSION}.dist-info")

# What an earlier install left: a file removed from python/kernmap since must not stay importable.
file(GLOB _old LIST_DIRECTORIES true "${_site}/kernmap-*.dist-info")
file(REMOVE_RECURSE "${_site}/kernmap" ${_old})

file(INSTALL "${KERNMAP_PY_SOURCE}" DESTINATION "${_site}" MESSAGE_NEVER PATTERN "__pycache__" EXCLUDE PATTERN "*.pyc" EXCLUDE)
file(INSTALL "${KERNMAP_PY_LIBRARY}" DESTINATION "${_site}/kernmap" MESSAGE_NEVER)
get_filename_component(_library_name "${KERNMAP_PY_LIBRARY}" NAME)
# The build's RPATH names the build tree; installed, the library finds torch's libraries in the torch package
# beside it (Python has loaded them already by then; this is for anything else that opens the library).
file(RPATH_SET FILE "${_site}/kernmap/${_library_name}" NEW_RPATH "\$ORIGIN/../torch/lib")

file(MAKE_DIRECTORY "${_site}/${_dist_info}")
file(WRITE "${_site}/${_dist_info}/METADATA"
  "Metadata-Version: 2.1\nName: kernmap\nVersion: ${KERNMAP_PY_VERSION}\nSummary: ${KERNMAP_PY_SUMMARY}\n"
  "Requires-Python: ${KERNMAP_PY_REQUIRES_PYTHON}\nRequires-Dist: torch\n")
file(WRITE "${_site}/${_dist_info}/INSTALLER" "kernmap-cmake\n")
# RECORD: every file of the distribution, relative to site-packages (hashes are optional; pip uninstall reads
# the paths).
file(GLOB_RECURSE _files RELATIVE "${_site}" "${_site}/kernmap/*" "${_site}/${_dist_info}/*")
list(FILTER _files EXCLUDE REGEX "/__pycache__/")
list(APPEND _files "${_dist_info}/RECORD")
list(SORT _files)
list(TRANSFORM _files APPEND ",,")
list(JOIN _files "\n" _record)
file(WRITE "${_site}/${_dist_info}/RECORD" "${_record}\n")
message(STATUS "kernmap: Python package ${KERNMAP_PY_VERSION} installed in ${_site}")
