// SHA-256 against FIPS 180-4 vectors, manifest.json / kernmap.lock validation (every malformed input gets an
// error naming the file, the field, the expected and the actual value), and the ELF checks of a library's
// bytes.
#include <elf.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "repository/elf_check.h"
#include "repository/manifest.h"
#include "repository/sha256.h"

namespace kernmap {
namespace {

namespace fs = std::filesystem;
using repository::FormatError;

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55, 56 and 64 bytes: the padding boundaries.
  EXPECT_EQ(sha256_hex(std::string(55, 'a')),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_hex(std::string(56, 'a')),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha256_hex(std::string(64, 'a')),
            "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST(Sha256, StreamingInOddChunksEqualsOneShot) {
  std::string data;
  for (int i = 0; i < 5000; ++i) data += static_cast<char>((i * 131) & 0xff);
  Sha256 h;
  for (size_t at = 0, step = 1; at < data.size(); at += step, step = step % 97 + 13)
    h.update(data.data() + at, std::min(step, data.size() - at));
  EXPECT_EQ(h.hex_digest(), sha256_hex(data));
}

TEST(Sha256, FileAndMissingFile) {
  const fs::path file = fs::temp_directory_path() / ("kernmap-sha-" + std::to_string(::getpid()));
  {
    std::FILE* f = std::fopen(file.c_str(), "wb");
    std::fputs("abc", f);
    std::fclose(f);
  }
  EXPECT_EQ(sha256_file(file.string()), sha256_hex("abc"));
  fs::remove(file);
  try {
    sha256_file(file.string());
    FAIL() << "expected an error for a missing file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
  }
}

const char* kSha = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

std::string manifest(const std::string& variant_extra = "", const std::string& top_extra = "",
                     const std::string& library = "lib/libx.so") {
  return std::string(R"({"name": "kmx", "version": "1.0", "plugin_abi": 1, "description": "d", )") +
         top_extra + R"("variants": [{"library": ")" + library + R"(", "sha256": ")" + kSha +
         R"(", "torch": "2.15", "cxx11_abi": true, "arch": "x86_64", "os": "linux", "toolkits": {"cann": "8.0"})" +
         variant_extra + "}]}";
}

// The FormatError message of parsing `text` as a manifest, or "" when it parsed.
std::string manifest_error(const std::string& text) {
  try {
    repository::parse_manifest(text, "repo/kmx/manifest.json");
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(Manifest, ParsesAValidManifest) {
  const repository::Manifest m = repository::parse_manifest(manifest(), "m.json");
  EXPECT_EQ(m.name, "kmx");
  EXPECT_EQ(m.version, "1.0");
  EXPECT_EQ(m.plugin_abi, 1);
  ASSERT_EQ(m.variants.size(), 1u);
  EXPECT_EQ(m.variants[0].library, "lib/libx.so");
  EXPECT_EQ(m.variants[0].sha256, kSha);
  EXPECT_EQ(m.variants[0].torch, "2.15");
  EXPECT_TRUE(m.variants[0].cxx11_abi);
  EXPECT_EQ(m.variants[0].toolkits.at("cann"), "8.0");
}

TEST(Manifest, ErrorsNameFileFieldExpectedAndActual) {
  struct Case {
    std::string text, expected_parts[3];
  };
  const Case cases[] = {
      {"{not json", {"repo/kmx/manifest.json", "not valid JSON", ""}},
      {"[]", {"top level", "expected an object", "array"}},
      {manifest("", R"("homepage": "x", )"), {"homepage", "no such field", "known fields"}},
      {manifest(R"(, "extra": 1)"), {"variants[0].extra", "no such field", "library"}},
      {R"({"name": "kmx", "version": "1", "plugin_abi": 1})", {"variants", "required field", "missing"}},
      {manifest().replace(manifest().find("\"plugin_abi\": 1"), 15, "\"plugin_abi\": \"1\""),
       {"plugin_abi", "expected an integer", "\"1\""}},
      {manifest().replace(manifest().find("\"kmx\""), 5, "\"Km X\""), {"name", "[a-z0-9_.-]", "\"Km X\""}},
      {manifest().replace(manifest().find(kSha), 64, "ABC"),
       {"variants[0].sha256", "64 lowercase hex", "\"ABC\""}},
      {manifest().replace(manifest().find("\"2.15\""), 6, "\"2\""),
       {"variants[0].torch", "major.minor", "\"2\""}},
      {manifest().replace(manifest().find("true"), 4, "1"), {"variants[0].cxx11_abi", "true or false", "1"}},
      {manifest("", "", "../other/lib.so"), {"variants[0].library", "no '..'", "\"../other/lib.so\""}},
      {manifest("", "", "lib/../../x.so"), {"variants[0].library", "no '..'", "lib/../../x.so"}},
      {manifest("", "", "/usr/lib/libc.so.6"), {"variants[0].library", "not an absolute path", "/usr/lib"}},
      {manifest("", "", "lib//x.so"), {"variants[0].library", "normalized", "lib//x.so"}},
      {manifest("", "", "./x.so"), {"variants[0].library", "normalized", "./x.so"}},
      {manifest().replace(manifest().find("\"8.0\""), 5, "8"),
       {"variants[0].toolkits.cann", "version string", "8"}},
      // nlohmann would stop at the NUL and take the document before it.
      {manifest() + std::string("\0garbage", 8),
       {"a NUL byte at offset " + std::to_string(manifest().size()), "", ""}},
  };
  for (const Case& c : cases) {
    const std::string error = manifest_error(c.text);
    ASSERT_FALSE(error.empty()) << "accepted: " << c.text;
    EXPECT_NE(error.find("repo/kmx/manifest.json"), std::string::npos) << error;
    for (const std::string& part : c.expected_parts)
      EXPECT_NE(error.find(part), std::string::npos) << "'" << part << "' not in: " << error;
  }
}

TEST(Lock, ParsesWritesAndReadsBack) {
  repository::Lock lock;
  lock.packages["kmx"] = {"1.0", {kSha}};
  lock.packages["kmy"] = {"2.0", {kSha, std::string(64, 'f')}};
  const std::string text = repository::lock_to_json(lock);
  const repository::Lock back = repository::parse_lock(text, "kernmap.lock");
  ASSERT_EQ(back.packages.size(), 2u);
  EXPECT_EQ(back.packages.at("kmy").version, "2.0");
  EXPECT_EQ(back.packages.at("kmy").sha256.size(), 2u);
  EXPECT_EQ(repository::lock_to_json(back), text);
}

TEST(Lock, ErrorsNameFieldExpectedAndActual) {
  const std::pair<std::string, std::string> cases[] = {
      {R"({"lock_version": 2, "packages": {}})", "lock_version: expected 1, got 2"},
      {R"({"lock_version": 1, "packages": {}, "x": 0})", "x: expected no such field"},
      {R"({"lock_version": 1, "packages": {"kmx": {"version": "1", "sha256": []}}})",
       "packages.kmx.sha256: expected a non-empty array"},
      {R"({"lock_version": 1, "packages": {"kmx": {"version": "1", "sha256": ["zz"]}}})",
       "packages.kmx.sha256[0]: expected 64 lowercase hex digits"},
      {R"({"lock_version": 1, "packages": {"kmx": {"version": "1", "sha256": [")" + std::string(kSha) +
           R"("], "pinned": true}}})",
       "packages.kmx.pinned: expected no such field"},
      {R"({"lock_version": 1, "packages": {"../x": {"version": "1", "sha256": []}}})", "\"../x\""},
      {std::string("{\"lock_version\": 1, \"packages\": {}}\0{", 37), "a NUL byte at offset 35"},
  };
  for (const auto& [text, part] : cases) {
    try {
      repository::parse_lock(text, "repo/kernmap.lock");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("repo/kernmap.lock: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
    }
  }
}

TEST(Manifest, ResolveInsideRejectsSymlinksThatEscape) {
  const fs::path root = fs::temp_directory_path() / ("kernmap-inside-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "pkg" / "lib");
  {
    std::FILE* f = std::fopen((root / "outside.so").c_str(), "wb");
    std::fclose(f);
  }
  {
    std::FILE* f = std::fopen((root / "pkg" / "lib" / "real.so").c_str(), "wb");
    std::fclose(f);
  }
  fs::create_symlink(root / "outside.so", root / "pkg" / "lib" / "escape.so");
  fs::create_symlink("real.so", root / "pkg" / "lib" / "alias.so");
  fs::create_directory_symlink(root, root / "pkg" / "up");
  const std::string pkg = (root / "pkg").string();
  EXPECT_EQ(repository::resolve_inside(pkg, "lib/alias.so", "m.json", "library"),
            fs::canonical(root / "pkg" / "lib" / "real.so").string());
  for (const std::string relative : {"lib/escape.so", "up/outside.so"}) {
    try {
      repository::resolve_inside(pkg, relative, "m.json", "variants[0].library");
      ADD_FAILURE() << relative << " accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(
          std::string(e.what()).find("variants[0].library: expected a library inside the package folder"),
          std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("outside.so"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(repository::resolve_inside(pkg, "lib/missing.so", "m.json", "library"), FormatError);
  fs::remove_all(root);
}

// A minimal ELF shared object of this byte order: the header, one PT_LOAD of the first 4096 bytes and a
// PT_GNU_STACK (no file bytes), padded to 4096 bytes.
constexpr unsigned char kNativeOrder = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? ELFDATA2LSB : ELFDATA2MSB;
constexpr repository::ElfTarget kX86_64{ELFCLASS64, kNativeOrder, EM_X86_64};

std::string elf_image(uint16_t machine = EM_X86_64, uint16_t type = ET_DYN) {
  Elf64_Ehdr h{};
  std::memcpy(h.e_ident, ELFMAG, SELFMAG);
  h.e_ident[EI_CLASS] = ELFCLASS64;
  h.e_ident[EI_DATA] = kNativeOrder;
  h.e_ident[EI_VERSION] = EV_CURRENT;
  h.e_type = type;
  h.e_machine = machine;
  h.e_version = EV_CURRENT;
  h.e_phoff = sizeof h;
  h.e_phentsize = sizeof(Elf64_Phdr);
  h.e_phnum = 2;
  h.e_ehsize = sizeof h;
  Elf64_Phdr phdr[2]{};
  phdr[0].p_type = PT_LOAD;
  phdr[0].p_filesz = 4096;
  phdr[0].p_memsz = 8192;
  phdr[1].p_type = PT_GNU_STACK;
  std::string image(4096, '\0');
  std::memcpy(image.data(), &h, sizeof h);
  std::memcpy(image.data() + sizeof h, phdr, sizeof phdr);
  return image;
}

// Overwrites a field of the image with `value` in native byte order.
template <typename T>
std::string with(std::string image, size_t offset, T value) {
  std::memcpy(image.data() + offset, &value, sizeof value);
  return image;
}

TEST(ElfCheck, AcceptsAWholeSharedObjectOfThisMachine) {
  EXPECT_EQ(repository::why_not_loadable(elf_image(), kX86_64), "");
}

TEST(ElfCheck, RefusesWhatDlopenWouldMapPastTheEndOrCannotLoad) {
  const size_t phdr0 = sizeof(Elf64_Ehdr);
  const std::pair<std::string, std::string> cases[] = {
      {"", "not an ELF file"},
      {"hello, this is text", "not an ELF file"},
      {elf_image().substr(0, 40), "a truncated ELF file: 40 bytes, less than its 64-byte header"},
      {elf_image().substr(0, 100),
       "its program header table (offset 64, 2 entries of 56 bytes) ends past byte 100, the end of the file"},
      {elf_image().substr(0, 3000),
       "program header 0 (PT_LOAD) maps 4096 bytes from offset 0 of the file, but the file has 3000 bytes "
       "(truncated?)"},
      // Offsets near 2^64: the range check must not wrap around.
      {with(elf_image(), phdr0 + offsetof(Elf64_Phdr, p_offset), uint64_t{0xffffffffffffff00}),
       "maps 4096 bytes from offset 18446744073709551360"},
      {with(elf_image(), offsetof(Elf64_Ehdr, e_phoff), uint64_t{0xfffffffffffffff0}),
       "its program header table (offset 18446744073709551600"},
      {with(elf_image(), offsetof(Elf64_Ehdr, e_phentsize), uint16_t{32}), "e_phentsize is 32 (expected 56)"},
      {with(elf_image(), offsetof(Elf64_Ehdr, e_phnum), uint16_t{0}), "without program headers"},
      {elf_image(EM_X86_64, ET_EXEC), "an ELF file of type 2 (expected 3, ET_DYN: a shared object)"},
      {elf_image(EM_AARCH64), "built for aarch64, this machine is x86_64"},
      {with(elf_image(EM_386), EI_CLASS, uint8_t{ELFCLASS32}),
       "built for i386 (32-bit), this machine is x86_64 (64-bit)"},
      {elf_image(EM_RISCV), "built for riscv64"},
      {elf_image(4242), "built for e_machine 4242"},
      {with(elf_image(), EI_CLASS, uint8_t{7}), "EI_CLASS is 7 (expected 1 or 2)"},
      {with(elf_image(), EI_VERSION, uint8_t{9}), "EI_VERSION is 9 (expected 1)"},
  };
  for (const auto& [image, part] : cases) {
    const std::string why = repository::why_not_loadable(image, kX86_64);
    EXPECT_NE(why.find(part), std::string::npos) << "'" << part << "' not in: '" << why << "'";
  }
}

}  // namespace
}  // namespace kernmap
