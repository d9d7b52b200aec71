// Poisoned allocations for the kernel tests: every block the CPU allocator hands out is filled with 0xFF
// bytes first, so an output element a kernel leaves unwritten reads as NaN, deterministically.
#pragma once

namespace kernmap::testing {

/// Puts the poisoning allocator in front of c10's CPU allocator for the rest of the process (call before the
/// first tensor). All-ones bytes are a NaN in every floating dtype (sign, exponent and mantissa bits all set)
/// and -1 in every integer dtype. kernmap's large-block cache (ops/memory.cpp) is switched off, so every
/// output comes from this allocator.
void install_poisoning_allocator();

}  // namespace kernmap::testing
