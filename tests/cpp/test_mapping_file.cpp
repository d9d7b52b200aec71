// Mapping files: JSON and the TOML subset parse to the same mapping, the mapping applies (user level and
// ScopedMapping), every error gives its location and problem, the TOML subset refuses what it does not
// support, and oversized or deeply nested input is refused cleanly. Real files in a temporary folder.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kernmap/c_api.h"
#include "kernmap/mapping_file.h"
#include "kernmap/registry.h"

namespace kernmap {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
namespace fs = std::filesystem;

KernelDescriptor kernel(std::string name, std::string layer, std::vector<std::string> devices) {
  KernelDescriptor d;
  d.name = std::move(name);
  d.layer = std::move(layer);
  d.devices = std::move(devices);
  d.dtypes = {"float32"};
  d.has_backward = true;
  d.compile_safe = true;
  return d;
}

// Layers and kernels of this test's own (the binary also holds the built-in ones; nothing here depends on
// them).
void register_test_kernels() {
  static const bool registered = [] {
    register_kernel(kernel("reference/mf_norm", "MfNorm", {"*"}));
    register_kernel(kernel("reference/mf_act", "MfAct", {"*"}));
    register_kernel(kernel("mf/fast", "MfNorm", {"cpu", "cuda"}));
    register_kernel(kernel("mf/slow", "MfNorm", {"cpu"}));
    register_kernel(kernel("mf/acme", "MfNorm", {"acme_dev"}));  // a device only a kernel names
    register_kernel(kernel("mf/act", "MfAct", {"*"}));
    return true;
  }();
  (void)registered;
}

class MappingFile : public ::testing::Test {
 protected:
  void SetUp() override {
    register_test_kernels();
    dir_ = fs::temp_directory_path() / ("kernmap_mapping_file_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    clear_user_mappings();
    fs::remove_all(dir_);
  }

  std::string write(const std::string& name, const std::string& text) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path.string();
  }

  // The message of the MappingFileError that loading `text` as `name` throws, with the folder cut off.
  std::string error_of(const std::string& name, const std::string& text) {
    const std::string path = write(name, text);
    try {
      load_mapping_file(path);
    } catch (const MappingFileError& e) {
      std::string message = e.what();
      const std::string prefix = dir_.string() + "/";
      for (size_t at; (at = message.find(prefix)) != std::string::npos;) message.erase(at, prefix.size());
      return message;
    }
    ADD_FAILURE() << name << " loaded without an error:\n" << text;
    return "";
  }

  fs::path dir_;
};

const Mapping kExpected = {
    {"MfNorm", {{"cpu", {{Mode::kTraining, "mf/fast"}, {Mode::kInference, "mf/slow"}}}}},
    {"MfAct",
     {{"cpu", {{Mode::kFallback, "mf/act"}}}, {"cuda", {{Mode::kTraining | Mode::kCompile, "mf/act"}}}}},
};

TEST_F(MappingFile, JsonAndTomlGiveTheSameMapping) {
  const std::string toml = write("m.toml", R"(# a comment line
kernmap_mapping = 1

[MfNorm.cpu]
training = "mf/fast"   # trailing comment
inference = 'mf/slow'

[MfAct]
cpu = "mf/act"                              # shorthand: the fallback entry
cuda = { "training+compile" = "mf/act" }
)");
  const std::string json = write("m.json", R"({"kernmap_mapping": 1,
  "MfNorm": {"cpu": {"training": "mf/fast", "inference": "mf/slow"}},
  "MfAct": {"cpu": "mf/act", "cuda": {"training+compile": "mf/act"}}})");
  EXPECT_EQ(load_mapping_file(toml), kExpected);
  EXPECT_EQ(load_mapping_file(json), kExpected);
}

TEST_F(MappingFile, TomlSpellingsOfTheSameMapping) {
  // Dotted keys, inline tables, quoted keys with escapes, CRLF, a byte-order mark and an upper-case
  // extension.
  const std::string a =
      write("a.TOML",
            "\xEF\xBB\xBF"
            "MfNorm.cpu.training = \"mf/fast\"\r\n"
            "MfNorm.cpu.\"inf\\u0065rence\" = \"mf/\\u0073low\"\r\n"
            "MfAct = { cpu.fallback = 'mf/act', cuda = { \"training+compile\" = \"mf/act\" } }\r\n");
  const std::string b = write("b.toml", R"(
[MfAct.cuda]
"training+compile" = "mf/act"
[MfNorm]
cpu = {training = "mf/fast", inference = "mf/slow"}
[MfAct.cpu]
fallback = "mf/act"
)");
  EXPECT_EQ(load_mapping_file(a), kExpected);
  EXPECT_EQ(load_mapping_file(b), kExpected);
}

TEST_F(MappingFile, RegisteredFileDrivesResolutionAndScopes) {
  EXPECT_EQ(resolve("MfNorm", "cpu", Mode::kInference).kernel->name, "reference/mf_norm");
  register_mapping_file(write("user.toml", "[MfNorm]\ncpu = \"mf/slow\"\n"));
  Decision d = resolve("MfNorm", "cpu", Mode::kInference);
  EXPECT_EQ(d.kernel->name, "mf/slow");
  EXPECT_EQ(d.source, "user");
  {
    ScopedMapping scope(
        load_mapping_file(write("scope.json", R"({"MfNorm": {"cpu": {"inference": "mf/fast"}}})")));
    d = resolve("MfNorm", "cpu", Mode::kInference);
    EXPECT_EQ(d.kernel->name, "mf/fast");
    EXPECT_EQ(d.source, "scoped");
  }
  EXPECT_EQ(resolve("MfNorm", "cpu", Mode::kInference).kernel->name, "mf/slow");
  // A device that only a registered kernel names is a known device.
  register_mapping_file(write("acme.toml", "MfNorm.acme_dev = \"mf/acme\"\n"));
  EXPECT_EQ(resolve("MfNorm", "acme_dev", Mode::kTraining).kernel->name, "mf/acme");
}

TEST_F(MappingFile, AFileWithAnErrorRegistersNothing) {
  const std::string path = write("half.toml", "[MfNorm]\ncpu = \"mf/slow\"\n[MfAct]\ncpu = \"mf/nope\"\n");
  EXPECT_THROW(register_mapping_file(path), MappingFileError);
  EXPECT_EQ(resolve("MfNorm", "cpu", Mode::kInference).kernel->name, "reference/mf_norm");
}

TEST_F(MappingFile, RegistryErrorsGiveLocationAndProblem) {
  EXPECT_THAT(error_of("layer.toml", "[MfNrom]\ncpu = \"mf/fast\"\n"),
              HasSubstr("layer.toml:1:2: unknown layer 'MfNrom' (known: "));
  EXPECT_THAT(error_of("layer.toml", "[MfNrom]\ncpu = \"mf/fast\"\n"), HasSubstr("MfAct, "));
  EXPECT_THAT(error_of("device.toml", "[MfNorm]\ncdua = \"mf/fast\"\n"),
              StartsWith("device.toml:2:1: unknown device 'cdua' for layer 'MfNorm' ("));
  EXPECT_THAT(error_of("device.toml", "[MfNorm]\ncdua = \"mf/fast\"\n"),
              HasSubstr("known: acme_dev, cpu, cuda, "));
  EXPECT_EQ(error_of("mode.toml", "[MfNorm.cpu]\ninfer = \"mf/fast\"\n"),
            "mode.toml:2:1: unknown mode 'infer' (accepted: inference, training, inference+compile, "
            "training+compile, fallback)");
  EXPECT_EQ(error_of("kernel.toml", "[MfNorm.cpu]\ntraining = \"mf/fsat\"\n"),
            "kernel.toml:2:12: unknown kernel 'mf/fsat' for layer 'MfNorm' on device 'cpu' (training) "
            "(registered kernels of layer 'MfNorm': mf/acme, mf/fast, mf/slow, reference/mf_norm)");
  EXPECT_EQ(error_of("other.toml", "[MfNorm]\ncpu = \"mf/act\"\n"),
            "other.toml:2:7: kernel 'mf/act' for layer 'MfNorm' on device 'cpu' (fallback) implements layer "
            "'MfAct', not 'MfNorm' (registered kernels of layer 'MfNorm': mf/acme, mf/fast, mf/slow, "
            "reference/mf_norm)");
  EXPECT_EQ(error_of("where.toml", "[MfNorm]\nnpu = \"mf/slow\"\n"),
            "where.toml:2:7: kernel 'mf/slow' for layer 'MfNorm' on device 'npu' (fallback) does not run on "
            "'npu' (its devices: cpu)");
  // JSON entries are located by their key path.
  EXPECT_THAT(error_of("kernel.json", R"({"MfNorm": {"cpu": {"training": "mf/fsat"}}})"),
              StartsWith("kernel.json: /MfNorm/cpu/training: unknown kernel 'mf/fsat'"));
  EXPECT_THAT(error_of("mode.json", R"({"MfNorm": {"cpu": {"infer": "mf/fast"}}})"),
              StartsWith("mode.json: /MfNorm/cpu/infer: unknown mode 'infer'"));
  EXPECT_THAT(error_of("short.json", R"({"MfNorm": {"cpu": "mf/act"}})"),
              StartsWith("short.json: /MfNorm/cpu: kernel 'mf/act' for layer"));
  EXPECT_THAT(error_of("esc.json", R"({"Mf/Norm~": {}})"),
              StartsWith("esc.json: /Mf~1Norm~0: unknown layer 'Mf/Norm~' (kn"));
}

TEST_F(MappingFile, EveryInvalidEntryIsReportedOnItsOwnLine) {
  const std::string message =
      error_of("many.toml", "[MfNorm.cpu]\ntraining = \"x/y\"\ninference = \"mf/act\"\n[Nope]\n");
  EXPECT_THAT(message, HasSubstr("many.toml:2:12: unknown kernel 'x/y'"));
  EXPECT_THAT(message, HasSubstr("\nmany.toml:3:13: kernel 'mf/act'"));
  EXPECT_THAT(message, HasSubstr("\nmany.toml:4:2: unknown layer 'Nope'"));
}

TEST_F(MappingFile, WrongTypesNameExpectedAndActual) {
  EXPECT_EQ(
      error_of("t1.toml", "MfNorm = \"mf/fast\"\n"),
      "t1.toml:1:10: layer 'MfNorm' must map to a table of devices ({device: kernel} or {device: {mode: "
      "kernel}}), got a string");
  EXPECT_EQ(
      error_of("t2.toml", "[MfNorm]\ncpu = 3\n"),
      "t2.toml:2:7: device 'cpu' of layer 'MfNorm' must map to a kernel name (a string) or a table {mode: "
      "kernel}, got an integer");
  EXPECT_EQ(
      error_of("t3.toml", "[MfNorm.cpu]\ntraining = true\n"),
      "t3.toml:2:12: mode 'training' of layer 'MfNorm' on device 'cpu' must map to a kernel name (a string), "
      "got a boolean");
  EXPECT_EQ(
      error_of("t4.toml", "[MfNorm.cpu.training]\n"),
      "t4.toml:1:13: mode 'training' of layer 'MfNorm' on device 'cpu' must map to a kernel name (a string), "
      "got a table");
  EXPECT_EQ(
      error_of("t1.json", R"({"MfNorm": {"cpu": {"training": 1.5}}})"),
      "t1.json: /MfNorm/cpu/training: mode 'training' of layer 'MfNorm' on device 'cpu' must map to a kernel "
      "name (a string), got a number");
  EXPECT_EQ(error_of("t2.json", R"({"MfNorm": {"cpu": ["mf/fast"]}})"),
            "t2.json: /MfNorm/cpu: device 'cpu' of layer 'MfNorm' must map to a kernel name (a string) or an "
            "object {mode: kernel}, got an array");
  EXPECT_EQ(error_of("t3.json", R"({"MfNorm": null})"),
            "t3.json: /MfNorm: layer 'MfNorm' must map to an object of devices ({device: kernel} or {device: "
            "{mode: kernel}}), got null");
  EXPECT_EQ(error_of("t4.json", R"(["MfNorm"])"),
            "t4.json: (top level): expected an object {layer: {device: ...}} at the top level, got an array");
}

TEST_F(MappingFile, VersionKey) {
  EXPECT_EQ(load_mapping_file(write("v.json", R"({"kernmap_mapping": 1})")), Mapping{});
  EXPECT_EQ(error_of("v2.toml", "kernmap_mapping = 2\n"),
            "v2.toml:1:19: mapping file format version 2 is not supported (this kernmap reads version 1)");
  EXPECT_EQ(error_of("v.toml", "kernmap_mapping = \"1\"\n"),
            "v.toml:1:19: kernmap_mapping must be an integer (the format version, 1), got a string");
}

TEST_F(MappingFile, FileErrorsNameTheFile) {
  EXPECT_EQ(error_of("m.yaml", "MfNorm: {}\n"),
            "m.yaml: unknown mapping file type '.yaml' (expected a file name ending in .json or .toml)");
  EXPECT_EQ(error_of("noext", "{}"),
            "noext: unknown mapping file type '' (expected a file name ending in .json or "
            ".toml)");
  const std::string missing = (dir_ / "missing.toml").string();
  try {
    load_mapping_file(missing);
    ADD_FAILURE() << "a missing file loaded";
  } catch (const MappingFileError& e) {
    EXPECT_EQ(std::string(e.what()), missing + ": cannot open the mapping file: No such file or directory");
  }
  fs::create_directories(dir_ / "folder.json");
  EXPECT_THROW(load_mapping_file((dir_ / "folder.json").string()), MappingFileError);
}

TEST_F(MappingFile, JsonSyntaxErrorsHaveLineAndColumn) {
  EXPECT_EQ(
      error_of("s.json", "{\"MfNorm\": {\n  \"cpu\": \"mf/fast\",\n}}"),
      "s.json:3:1: invalid JSON: syntax error while parsing object key - unexpected '}'; expected string "
      "literal");
  EXPECT_THAT(error_of("e.json", ""), HasSubstr("e.json:1:1: invalid JSON: "));
  EXPECT_EQ(error_of("d.json", R"({"MfNorm": {"cpu": "mf/fast", "cpu": "mf/slow"}})"),
            "d.json: /MfNorm/cpu: duplicate key 'cpu'");
}

TEST_F(MappingFile, TomlDuplicatesAreErrors) {
  EXPECT_EQ(error_of("k.toml", "[MfNorm]\ncpu = \"mf/fast\"\ncpu = \"mf/slow\"\n"),
            "k.toml:3:1: duplicate key MfNorm.cpu (first defined at line 2, column 1)");
  EXPECT_EQ(error_of("t.toml", "[MfNorm.cpu]\n[MfAct]\n[MfNorm.cpu]\n"),
            "t.toml:3:1: table [MfNorm.cpu] is already defined (at line 1, column 9)");
  EXPECT_EQ(error_of("v.toml", "[MfNorm]\ncpu = \"mf/fast\"\n[MfNorm.cpu]\n"),
            "v.toml:3:9: key MfNorm.cpu already has a value (at line 2, column 1), so it cannot be a table");
  // A table defined by dotted keys cannot be reopened by a header; an inline table cannot be extended.
  EXPECT_EQ(error_of("dh.toml", "MfNorm.cpu.training = \"mf/fast\"\n[MfNorm.cpu]\n"),
            "dh.toml:2:1: table [MfNorm.cpu] is already defined (at line 1, column 8)");
  EXPECT_EQ(error_of("it.toml", "MfNorm = { cpu = \"mf/fast\" }\n[MfNorm.cuda]\n"),
            "it.toml:2:2: table MfNorm is an inline table (at line 1, column 10) and cannot be extended");
  EXPECT_EQ(
      error_of("id.toml", "MfNorm = { cpu = {} }\nMfNorm.cpu.training = \"mf/fast\"\n"),
      "id.toml:2:1: table MfNorm is defined at line 1, column 10; keys cannot be added to it from here");
  EXPECT_EQ(
      error_of("hd.toml", "[MfNorm.cpu]\n[MfNorm]\ncpu.training = \"mf/fast\"\n"),
      "hd.toml:3:1: table MfNorm.cpu is defined at line 1, column 9; keys cannot be added to it from here");
  // An implicitly created table may be defined once by its own header.
  EXPECT_EQ(load_mapping_file(write("ok.toml", "[MfNorm.cpu]\ntraining = \"mf/fast\"\n[MfNorm]\n")).size(),
            1u);
}

TEST_F(MappingFile, TomlStringErrors) {
  EXPECT_EQ(error_of("u.toml", "[MfNorm]\ncpu = \"mf/fast\n"),
            "u.toml:2:7: unterminated string (a string must end with '\"' on the same line)");
  EXPECT_EQ(error_of("ul.toml", "[MfNorm]\ncpu = 'mf/fast\n"),
            "ul.toml:2:7: unterminated string (a literal string must end with \"'\" on the same line)");
  EXPECT_EQ(error_of("e.toml", "[MfNorm]\ncpu = \"mf\\qfast\"\n"),
            "e.toml:2:10: invalid escape '\\q' (valid: \\b \\t \\n \\f \\r \\\" \\\\ \\uXXXX \\UXXXXXXXX)");
  EXPECT_EQ(error_of("eu.toml", "[MfNorm]\ncpu = \"\\u12\"\n"),
            "eu.toml:2:8: invalid escape: \\u needs 4 hexadecimal digits");
  EXPECT_EQ(error_of("es.toml", "[MfNorm]\ncpu = \"\\uD800\"\n"),
            "es.toml:2:8: invalid escape: U+D800 is not a Unicode scalar value");
  EXPECT_EQ(error_of("c.toml", "[MfNorm]\ncpu = \"mf\x01\"\n"),
            "c.toml:2:10: control character U+0001 in a string (control characters other than tab are not "
            "allowed)");
  EXPECT_EQ(error_of("utf.toml", "[MfNorm]\n# caf\xC3\xA9 \xFF\n"),
            "utf.toml:2:8: the file is not valid UTF-8 (TOML files must be UTF-8)");
  EXPECT_EQ(error_of("ml.toml", "[MfNorm]\ncpu = \"\"\"mf/fast\"\"\"\n"),
            "ml.toml:2:7: multi-line strings (\"\"\") are not supported in mapping files");
}

TEST_F(MappingFile, TomlUnsupportedConstructsAreNamed) {
  EXPECT_EQ(error_of("a.toml", "[MfNorm]\ncpu = [\"mf/fast\"]\n"),
            "a.toml:2:7: arrays are not supported in mapping files (a value is a \"kernel\" string or a { "
            "table })");
  EXPECT_EQ(error_of("aot.toml", "[[MfNorm]]\n"),
            "aot.toml:1:1: arrays of tables ([[...]]) are not supported in mapping files");
  EXPECT_EQ(error_of("d.toml", "when = 1979-05-27T07:32:00Z\n"),
            "d.toml:1:8: dates and times are not supported in mapping files (1979-05-27T07:32:00Z)");
  EXPECT_EQ(error_of("f.toml", "x = 3.14\n"), "f.toml:1:5: floats are not supported in mapping files (3.14)");
  EXPECT_EQ(error_of("h.toml", "x = 0xff\n"),
            "h.toml:1:5: hexadecimal, octal and binary integers are not supported in mapping files (0xff)");
  EXPECT_EQ(error_of("b.toml", "[MfNorm]\ncpu = mf\n"),
            "b.toml:2:7: expected a value, got the bare word 'mf' (strings must be in quotes: \"mf\")");
  EXPECT_EQ(error_of("tc.toml", "MfNorm = { cpu = \"mf/fast\", }\n"),
            "tc.toml:1:29: trailing comma in an inline table (TOML does not allow one)");
  EXPECT_EQ(error_of("nl.toml", "MfNorm = { cpu = \"mf/fast\",\n cuda = \"mf/fast\" }\n"),
            "nl.toml:1:28: expected a key (letters, digits, '_', '-', or a quoted string), got end of line");
  EXPECT_EQ(error_of("eq.toml", "[MfNorm]\ncpu \"mf/fast\"\n"),
            "eq.toml:2:5: expected '=' after the key cpu, got '\"'");
  EXPECT_EQ(error_of("hdr.toml", "[MfNorm\ncpu = \"mf/fast\"\n"),
            "hdr.toml:1:8: expected ']' to close the table header, got end of line");
  EXPECT_EQ(error_of("eol.toml", "[MfNorm]\ncpu = \"mf/fast\" \"x\"\n"),
            "eol.toml:2:17: expected the end of the line after the value, got '\"'");
  EXPECT_EQ(error_of("cr.toml", "[MfNorm]\rcpu = \"mf/fast\"\n"),
            "cr.toml:1:9: carriage return without a line feed (lines end with LF or CRLF)");
  EXPECT_EQ(error_of("nv.toml", "[MfNorm]\ncpu =\n"),
            "nv.toml:2:6: expected a value (a \"string\", a 'string' or an "
            "{ inline table }), got end of line");
}

TEST_F(MappingFile, HugeAndDeepInputIsRefusedCleanly) {
  const std::string big = "# " + std::string(1 << 20, 'x') + "\n";
  EXPECT_THAT(error_of("big.toml", big),
              HasSubstr("big.toml: the file is larger than the 1048576-byte limit"));
  EXPECT_EQ(error_of("deep.json", std::string(100000, '[') + std::string(100000, ']')),
            "deep.json: /0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0: nested deeper than 16 levels");
  std::string deep_toml = "x = ";
  for (int i = 0; i < 100000; ++i) deep_toml += "{a = ";
  EXPECT_EQ(error_of("deep.toml", deep_toml), "deep.toml:1:85: tables nested deeper than 16 levels");
  std::string dotted = "x";
  for (int i = 0; i < 20; ++i) dotted += ".a";
  EXPECT_EQ(error_of("dotted.toml", dotted + " = \"k\"\n"),
            "dotted.toml:1:41: keys nested deeper than 16 levels");
  std::string wide = "{\"MfNorm\": {";
  for (int i = 0; i < 70000; ++i) wide += (i ? ",\"" : "\"") + std::to_string(i) + "\":1";
  EXPECT_EQ(error_of("wide.json", wide + "}}"), "wide.json: /MfNorm: more than 65536 values in one file");
}

TEST_F(MappingFile, CApiLoadsAndRegistersFiles) {
  const std::string path = write("c.toml", "[MfNorm]\ncpu = \"mf/slow\"\n");
  char* text = nullptr;
  char* error = nullptr;
  ASSERT_EQ(kernmap_load_mapping_file(path.c_str(), &text, &error), KERNMAP_OK);
  EXPECT_EQ(nlohmann::json::parse(text),
            nlohmann::json::parse(R"({"MfNorm": {"cpu": {"fallback": "mf/slow"}}})"));
  kernmap_free(text);
  ASSERT_EQ(kernmap_register_mapping_file(path.c_str(), &error), KERNMAP_OK);
  EXPECT_EQ(resolve("MfNorm", "cpu", Mode::kTraining).kernel->name, "mf/slow");

  const std::string bad = write("c.json", R"({"MfNorm": {"cpu": "mf/nope"}})");
  EXPECT_EQ(kernmap_register_mapping_file(bad.c_str(), &error), KERNMAP_INVALID_ARGUMENT);
  ASSERT_NE(error, nullptr);
  EXPECT_THAT(std::string(error), HasSubstr("c.json: /MfNorm/cpu: unknown kernel 'mf/nope'"));
  kernmap_free(error);
  error = nullptr;
  EXPECT_EQ(kernmap_load_mapping_file(nullptr, &text, &error), KERNMAP_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(error), "kernmap_load_mapping_file: path is NULL");
  kernmap_free(error);
}

}  // namespace
}  // namespace kernmap
