// SHA-256 against FIPS 180-4 vectors, and manifest.json / kernmap.lock validation: every malformed input gets
// an error naming the file, the field, the expected and the actual value.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

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

}  // namespace
}  // namespace kernmap
