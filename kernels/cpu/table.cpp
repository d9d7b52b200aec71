// This level's KernelTable, compiled once per instruction-set level like the kernels (KERNMAP_CPU_LEVEL names
// the level): the address of every entry point of entry_points.h, in its order.
#include "kernels/cpu/isa.h"

namespace kernmap::cpu {
namespace KERNMAP_CPU_LEVEL {

#define KERNMAP_CPU_ADDRESS(name, ret, params) &name,
extern const KernelTable kTable = {KERNMAP_CPU_ENTRY_POINTS(KERNMAP_CPU_ADDRESS)};
#undef KERNMAP_CPU_ADDRESS

}  // namespace KERNMAP_CPU_LEVEL
}  // namespace kernmap::cpu
