# The CMake package that `cmake --install` writes (docs/cmake.md):
#
#   include/kernmap/*.h                     the public headers
#   lib/libkernmap{,_models,_train}.so      RPATH: $ORIGIN (each other) and the torch lib folder of the build
#   bin/kernmap                             the CLI (RPATH: ../lib and the torch lib folder)
#   lib/cmake/kernmap/                      kernmapConfig.cmake, kernmapConfigVersion.cmake, the exported
#                                           targets, kernmapTorchTarget.cmake
#
# Targets for consumers (namespace kernmap::): kernmap (registry + ops), models (layers, kernelize, models),
# train, cli (the executable), plugin (headers + torch, for plugins, which reach kernmap only through the host
# struct of include/kernmap/plugin.h), torch_cpu (the torch kernmap was built against, defined by the config).
# Components: "runtime" (libraries, CLI) and "devel" (headers, CMake files). The wheel (SKBUILD) does not
# include this file: it installs only the "python" component.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KERNMAP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kernmap")

# The plugin ABI version, for plugin projects' manifests (KERNMAP_PLUGIN_ABI_VERSION in the config).
file(STRINGS "${CMAKE_SOURCE_DIR}/include/kernmap/plugin.h" _abi_line REGEX "^#define KERNMAP_PLUGIN_ABI_VERSION [0-9]+")
if(NOT _abi_line MATCHES "KERNMAP_PLUGIN_ABI_VERSION ([0-9]+)")
  message(FATAL_ERROR "kernmap: include/kernmap/plugin.h does not define KERNMAP_PLUGIN_ABI_VERSION")
endif()
set(KERNMAP_PLUGIN_ABI_VERSION "${CMAKE_MATCH_1}")

# Plugins: the headers and torch, not libkernmap.
add_library(kernmap_plugin INTERFACE)
target_include_directories(kernmap_plugin INTERFACE "$<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/include>")
target_link_libraries(kernmap_plugin INTERFACE kernmap::torch_cpu)

set_target_properties(kernmap_models PROPERTIES EXPORT_NAME models)
set_target_properties(kernmap_train PROPERTIES EXPORT_NAME train)
set_target_properties(kernmap_cli PROPERTIES EXPORT_NAME cli)
set_target_properties(kernmap_plugin PROPERTIES EXPORT_NAME plugin)

# Installed binaries find each other through $ORIGIN and torch where the build found it (absolute). A consumer
# that points KERNMAP_TORCH_DIR elsewhere links that torch, and its executables load it first (by soname).
file(RELATIVE_PATH _bin_to_lib "/${CMAKE_INSTALL_BINDIR}" "/${CMAKE_INSTALL_LIBDIR}")
set_target_properties(kernmap kernmap_models kernmap_train PROPERTIES
  INSTALL_RPATH "$ORIGIN;${KERNMAP_TORCH_LIB_DIR}")
set_target_properties(kernmap_cli PROPERTIES INSTALL_RPATH "$ORIGIN/${_bin_to_lib};${KERNMAP_TORCH_LIB_DIR}")

install(TARGETS kernmap kernmap_models kernmap_train kernmap_cli kernmap_plugin
  EXPORT kernmapTargets
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT runtime
  RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT runtime
  INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(DIRECTORY "${CMAKE_SOURCE_DIR}/include/kernmap" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
  COMPONENT devel FILES_MATCHING PATTERN "*.h")
install(EXPORT kernmapTargets NAMESPACE kernmap:: DESTINATION "${KERNMAP_INSTALL_CMAKEDIR}" COMPONENT devel)

configure_package_config_file("${CMAKE_SOURCE_DIR}/cmake/kernmapConfig.cmake.in"
  "${CMAKE_BINARY_DIR}/cmake/kernmapConfig.cmake" INSTALL_DESTINATION "${KERNMAP_INSTALL_CMAKEDIR}")
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file("${CMAKE_BINARY_DIR}/cmake/kernmapConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_BINARY_DIR}/cmake/kernmapConfig.cmake" "${CMAKE_BINARY_DIR}/cmake/kernmapConfigVersion.cmake"
  DESTINATION "${KERNMAP_INSTALL_CMAKEDIR}" COMPONENT devel)
install(FILES "${CMAKE_SOURCE_DIR}/cmake/TorchTarget.cmake" RENAME kernmapTorchTarget.cmake
  DESTINATION "${KERNMAP_INSTALL_CMAKEDIR}" COMPONENT devel)
