# Run by `cmake --install` (CMakeLists.txt's install(CODE)) after the library is installed: writes the package
# folder's manifest.json (docs/plugins.md) from manifest.json.in with the sha256 of the installed library.
# In: KMEXAMPLE_PACKAGE_DIR, KMEXAMPLE_LIBRARY (relative to it), KMEXAMPLE_MANIFEST_TEMPLATE and the other
# KMEXAMPLE_* fields of the template.
set(_library "${KMEXAMPLE_PACKAGE_DIR}/${KMEXAMPLE_LIBRARY}")
if(NOT EXISTS "${_library}")
  message(FATAL_ERROR "kmexample: ${_library} was not installed; cannot write the manifest")
endif()
file(SHA256 "${_library}" KMEXAMPLE_SHA256)
message(STATUS "Installing: ${KMEXAMPLE_PACKAGE_DIR}/manifest.json (sha256 ${KMEXAMPLE_SHA256})")
configure_file("${KMEXAMPLE_MANIFEST_TEMPLATE}" "${KMEXAMPLE_PACKAGE_DIR}/manifest.json" @ONLY)
