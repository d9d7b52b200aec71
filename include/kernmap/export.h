/* KERNMAP_API marks what kernmap's shared libraries (libkernmap, libkernmap_models, libkernmap_train) export.
 * They are built with -fvisibility=hidden: only the declarations of include/kernmap/ marked with it (classes,
 * functions, the C API) are visible to programs, plugins and Python; everything else stays inside its
 * library. The same mark serves a library's own build and its users (ELF has no import/export distinction). C
 * and C++. */
#ifndef KERNMAP_EXPORT_H_
#define KERNMAP_EXPORT_H_

#define KERNMAP_API __attribute__((visibility("default")))

#endif /* KERNMAP_EXPORT_H_ */
