// Internal: whether a plugin library's bytes are an ELF shared object this process can map, checked before
// dlopen sees them. dlopen trusts the file: a program header that points past the end of a truncated file
// maps pages that do not exist, and the first touch of one kills the process with SIGBUS. Torch-free and
// over bytes only, so that the fuzz target and the tests of the manifest parser link it alone.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kernmap::repository {

/// What an ELF file is built for: its e_ident class (word size) and data (byte order), and its e_machine.
struct ElfTarget {
  unsigned char elf_class = 0;  ///< ELFCLASS32 or ELFCLASS64
  unsigned char data = 0;       ///< ELFDATA2LSB or ELFDATA2MSB
  uint16_t machine = 0;         ///< EM_X86_64, EM_AARCH64, ...
};

/// The machine's name as `uname -m` spells it ("x86_64", "aarch64", "ppc64le"), or "e_machine N" for one
/// this table does not know.
std::string machine_name(const ElfTarget& target);

/// Why `image`, a whole library file, is not an ELF shared object that a process built for `host` can map:
/// not ELF, built for another machine ("built for aarch64, this machine is x86_64"), word size or byte order,
/// not ET_DYN, a malformed header, or a program header whose bytes lie past the end of the file (truncated).
/// "" when it can be mapped.
std::string why_not_loadable(std::string_view image, const ElfTarget& host);

}  // namespace kernmap::repository
