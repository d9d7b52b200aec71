// ELF header and program header checks (repository/elf_check.h), per the System V gABI: e_ident, then the
// header fields at their offsets for the file's class, read in the file's byte order.
#include "repository/elf_check.h"

#include <elf.h>

#include <cstddef>

namespace kernmap::repository {
namespace {

// Reads the file's fields in its own byte order, so that a file of another order is described, not misread.
class Reader {
 public:
  Reader(std::string_view image, bool little) : image_(image), little_(little) {}
  uint64_t field(uint64_t offset, size_t width) const {
    uint64_t value = 0;
    for (size_t i = 0; i < width; ++i) {
      const auto byte = static_cast<unsigned char>(image_[offset + i]);
      value |= uint64_t{byte} << (8 * (little_ ? i : width - 1 - i));
    }
    return value;
  }

 private:
  std::string_view image_;
  bool little_;
};

// Where the fields this check reads lie, for one ELF class.
struct Layout {
  size_t header_size, e_type, e_machine, e_phoff, e_phentsize, e_phnum, word;
  size_t phdr_size, p_type, p_offset, p_filesz;
};

template <typename Ehdr, typename Phdr>
constexpr Layout layout_of() {
  return {sizeof(Ehdr),
          offsetof(Ehdr, e_type),
          offsetof(Ehdr, e_machine),
          offsetof(Ehdr, e_phoff),
          offsetof(Ehdr, e_phentsize),
          offsetof(Ehdr, e_phnum),
          sizeof(Ehdr::e_phoff),
          sizeof(Phdr),
          offsetof(Phdr, p_type),
          offsetof(Phdr, p_offset),
          offsetof(Phdr, p_filesz)};
}

constexpr Layout kElf32 = layout_of<Elf32_Ehdr, Elf32_Phdr>();
constexpr Layout kElf64 = layout_of<Elf64_Ehdr, Elf64_Phdr>();

std::string bits(unsigned char elf_class) {
  return elf_class == ELFCLASS64 ? "64-bit" : "32-bit";
}

std::string byte_order(unsigned char data) {
  return data == ELFDATA2LSB ? "little-endian" : "big-endian";
}

std::string segment_type(uint64_t type) {
  switch (type) {
    case PT_LOAD:
      return "PT_LOAD";
    case PT_DYNAMIC:
      return "PT_DYNAMIC";
    case PT_INTERP:
      return "PT_INTERP";
    case PT_NOTE:
      return "PT_NOTE";
    case PT_TLS:
      return "PT_TLS";
    case PT_GNU_EH_FRAME:
      return "PT_GNU_EH_FRAME";
    case PT_GNU_RELRO:
      return "PT_GNU_RELRO";
    case PT_GNU_PROPERTY:
      return "PT_GNU_PROPERTY";
    default:
      return "type " + std::to_string(type);
  }
}

}  // namespace

std::string machine_name(const ElfTarget& target) {
  const bool wide = target.elf_class == ELFCLASS64;
  switch (target.machine) {
    case EM_X86_64:
      return wide ? "x86_64" : "x32";
    case EM_386:
      return "i386";
    case EM_AARCH64:
      return target.data == ELFDATA2MSB ? "aarch64_be" : "aarch64";
    case EM_ARM:
      return "arm";
    case EM_PPC64:
      return target.data == ELFDATA2LSB ? "ppc64le" : "ppc64";
    case EM_PPC:
      return "ppc";
    case EM_S390:
      return wide ? "s390x" : "s390";
    case EM_RISCV:
      return wide ? "riscv64" : "riscv32";
    case EM_LOONGARCH:
      return wide ? "loongarch64" : "loongarch32";
    case EM_MIPS:
      return wide ? "mips64" : "mips";
    case EM_SPARCV9:
      return "sparc64";
    default:
      return "e_machine " + std::to_string(target.machine);
  }
}

std::string why_not_loadable(std::string_view image, const ElfTarget& host) {
  if (image.size() < EI_NIDENT || image.substr(0, SELFMAG) != std::string_view(ELFMAG, SELFMAG))
    return "not an ELF file (a shared library starts with \\x7fELF)";
  ElfTarget file{static_cast<unsigned char>(image[EI_CLASS]), static_cast<unsigned char>(image[EI_DATA]), 0};
  if (file.elf_class != ELFCLASS32 && file.elf_class != ELFCLASS64)
    return "a malformed ELF file: EI_CLASS is " + std::to_string(file.elf_class) + " (expected 1 or 2)";
  if (file.data != ELFDATA2LSB && file.data != ELFDATA2MSB)
    return "a malformed ELF file: EI_DATA is " + std::to_string(file.data) + " (expected 1 or 2)";
  const Layout& at = file.elf_class == ELFCLASS64 ? kElf64 : kElf32;
  if (image.size() < at.header_size) {
    return "a truncated ELF file: " + std::to_string(image.size()) + " bytes, less than its " +
           std::to_string(at.header_size) + "-byte header";
  }
  const Reader read(image, file.data == ELFDATA2LSB);
  file.machine = static_cast<uint16_t>(read.field(at.e_machine, 2));
  if (file.machine != host.machine || file.elf_class != host.elf_class || file.data != host.data) {
    // The word size and byte order are named where they differ: "built for i386 (32-bit), this machine is
    // x86_64 (64-bit)".
    const auto described = [&](const ElfTarget& t) {
      std::string details;
      if (file.elf_class != host.elf_class) details = bits(t.elf_class);
      if (file.data != host.data) details += (details.empty() ? "" : ", ") + byte_order(t.data);
      return machine_name(t) + (details.empty() ? "" : " (" + details + ")");
    };
    return "built for " + described(file) + ", this machine is " + described(host);
  }
  if (const auto version = static_cast<unsigned char>(image[EI_VERSION]); version != EV_CURRENT)
    return "a malformed ELF file: EI_VERSION is " + std::to_string(version) + " (expected 1)";
  const uint64_t type = read.field(at.e_type, 2);
  if (type != ET_DYN) {
    return "an ELF file of type " + std::to_string(type) + " (expected " + std::to_string(ET_DYN) +
           ", ET_DYN: a shared object)";
  }

  // The program header table, then every segment's bytes, inside the file. The comparisons subtract from
  // the file size, which is known to be larger, so that no sum of untrusted fields can wrap around.
  const uint64_t size = image.size();
  const uint64_t phoff = read.field(at.e_phoff, at.word);
  const uint64_t phentsize = read.field(at.e_phentsize, 2);
  const uint64_t phnum = read.field(at.e_phnum, 2);
  if (phentsize != at.phdr_size) {
    return "a malformed ELF file: e_phentsize is " + std::to_string(phentsize) + " (expected " +
           std::to_string(at.phdr_size) + ")";
  }
  if (phnum == 0) return "an ELF file without program headers (nothing to load)";
  if (phoff > size || phnum * phentsize > size - phoff) {
    return "its program header table (offset " + std::to_string(phoff) + ", " + std::to_string(phnum) +
           " entries of " + std::to_string(phentsize) + " bytes) ends past byte " + std::to_string(size) +
           ", the end of the file (truncated?)";
  }
  for (uint64_t i = 0; i < phnum; ++i) {
    const uint64_t entry = phoff + i * phentsize;
    const uint64_t offset = read.field(entry + at.p_offset, at.word);
    const uint64_t filesz = read.field(entry + at.p_filesz, at.word);
    if (filesz == 0) continue;
    if (offset > size || filesz > size - offset) {
      return "program header " + std::to_string(i) + " (" + segment_type(read.field(entry + at.p_type, 4)) +
             ") maps " + std::to_string(filesz) + " bytes from offset " + std::to_string(offset) +
             " of the file, but the file has " + std::to_string(size) + " bytes (truncated?)";
    }
  }
  return "";
}

}  // namespace kernmap::repository
