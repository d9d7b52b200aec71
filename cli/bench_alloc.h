// The benchmark's CPU allocator: freed blocks of 1 MiB and more are kept and handed out again for the same
// size, so that no timed repetition pays for page faults (docs/development.md, "Benchmarks").
#pragma once

#include <cstdint>

namespace kernmap::cli {

/// Installs the keeping allocator above c10's CPU allocator (once; a later call only sets huge_pages). Call
/// before kernmap::count_cpu_memory(), so that the count wraps it and counts tensors, not kept blocks. With
/// huge_pages, blocks of 16 MiB and more are mapped on 2 MiB boundaries with the transparent-huge-page hint,
/// as the copy probes' buffers and kernmap's large blocks are (not with KERNMAP_HUGE_PAGES=0). Returns
/// whether that is on.
bool keep_freed_memory(bool huge_pages);
/// Returns the kept blocks to the system (between cases, whose sizes differ); returns the bytes released.
int64_t release_freed_memory();

}  // namespace kernmap::cli
