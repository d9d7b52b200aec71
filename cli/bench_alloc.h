// The benchmark's CPU allocator: freed blocks of 1 MiB and more are kept and handed out again for the same
// size, so that no timed repetition pays for page faults (docs/development.md, "Benchmarks").
#pragma once

#include <cstdint>

namespace kernmap::cli {

/// Installs the keeping allocator above c10's CPU allocator (once; later calls do nothing). Call before
/// kernmap::count_cpu_memory(), so that the count wraps it and counts tensors, not kept blocks.
void keep_freed_memory();
/// Returns the kept blocks to the system (between cases, whose sizes differ); returns the bytes released.
int64_t release_freed_memory();

}  // namespace kernmap::cli
