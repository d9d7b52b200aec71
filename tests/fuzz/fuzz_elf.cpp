// libFuzzer target: arbitrary bytes as a plugin library's file, checked as the loader checks them before
// dlopen. The check must return (never read outside the bytes: ASan), and what it accepts must be what dlopen
// can map without touching a page past the end: an ELF header of this machine and every program header's file
// bytes inside the input, restated here independently of repository/elf_check.cpp.
#include <elf.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "repository/elf_check.h"

namespace {

constexpr kernmap::repository::ElfTarget kHost{ELFCLASS64, ELFDATA2LSB, EM_X86_64};

// Every program header's [p_offset, p_offset + p_filesz) inside the input, for a 64-bit little-endian file.
bool segments_inside(const uint8_t* data, size_t size) {
  if (size < sizeof(Elf64_Ehdr)) return false;
  Elf64_Ehdr h;
  std::memcpy(&h, data, sizeof h);
  if (h.e_phentsize != sizeof(Elf64_Phdr) || h.e_phoff > size) return false;
  if (static_cast<unsigned __int128>(h.e_phnum) * sizeof(Elf64_Phdr) > size - h.e_phoff) return false;
  for (size_t i = 0; i < h.e_phnum; ++i) {
    Elf64_Phdr p;
    std::memcpy(&p, data + h.e_phoff + i * sizeof p, sizeof p);
    if (p.p_filesz > 0 &&
        static_cast<unsigned __int128>(p.p_offset) + p.p_filesz > static_cast<unsigned __int128>(size))
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view image(reinterpret_cast<const char*>(data), size);
  const std::string why = kernmap::repository::why_not_loadable(image, kHost);
  if (!why.empty()) return 0;
  if (size < EI_NIDENT || std::memcmp(data, ELFMAG, SELFMAG) != 0) std::abort();
  if (data[EI_CLASS] != ELFCLASS64 || data[EI_DATA] != ELFDATA2LSB) std::abort();
  uint16_t type = 0, machine = 0;
  std::memcpy(&type, data + offsetof(Elf64_Ehdr, e_type), 2);
  std::memcpy(&machine, data + offsetof(Elf64_Ehdr, e_machine), 2);
  if (type != ET_DYN || machine != EM_X86_64 || !segments_inside(data, size)) std::abort();
  return 0;
}
