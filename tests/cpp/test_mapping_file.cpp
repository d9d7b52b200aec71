// Mapping files: JSON and TOML parse to the same mapping, the mapping applies (user level and ScopedMapping),
// every error gives its location and problem (TOML syntax errors are toml++'s, at its location), TOML values
// outside the mapping's shape are named, and oversized or deeply nested input is refused cleanly. Real files
// in a temporary folder.
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
  // nlohmann would stop at the NUL and take the document before it, ignoring the rest.
  EXPECT_EQ(error_of("n.json", std::string("{\"MfNorm\": {}}\n\0{\"garbage\"", 26)),
            "n.json:2:1: a NUL byte (offset 15; JSON text cannot hold one)");
}

// TOML syntax is toml++'s: its message after "invalid TOML: ", at the location it reports.
TEST_F(MappingFile, TomlDuplicatesAreErrors) {
  EXPECT_EQ(
      error_of("k.toml", "[MfNorm]\ncpu = \"mf/fast\"\ncpu = \"mf/slow\"\n"),
      "k.toml:3:7: invalid TOML: Error while parsing key-value pair: cannot redefine existing string 'cpu'");
  EXPECT_EQ(error_of("t.toml", "[MfNorm.cpu]\n[MfAct]\n[MfNorm.cpu]\n"),
            "t.toml:3:1: invalid TOML: Error while parsing table header: cannot redefine existing table "
            "'MfNorm.cpu'");
  EXPECT_EQ(error_of("v.toml", "[MfNorm]\ncpu = \"mf/fast\"\n[MfNorm.cpu]\n"),
            "v.toml:3:1: invalid TOML: Error while parsing table header: cannot redefine existing string "
            "'MfNorm.cpu' as table");
  // A table defined by dotted keys cannot be reopened by a header; an inline table cannot be extended.
  EXPECT_EQ(error_of("dh.toml", "MfNorm.cpu.training = \"mf/fast\"\n[MfNorm.cpu]\n"),
            "dh.toml:2:1: invalid TOML: Error while parsing table header: cannot redefine existing table "
            "'MfNorm.cpu'");
  EXPECT_EQ(error_of("it.toml", "MfNorm = { cpu = \"mf/fast\" }\n[MfNorm.cuda]\n"),
            "it.toml:2:15: invalid TOML: Error while parsing table header: cannot insert 'MfNorm.cuda' into "
            "existing inline table");
  EXPECT_EQ(
      error_of("id.toml", "MfNorm = { cpu = {} }\nMfNorm.cpu.training = \"mf/fast\"\n"),
      "id.toml:2:1: invalid TOML: Error while parsing key-value pair: cannot redefine existing table as "
      "dotted key-value pair");
  EXPECT_EQ(
      error_of("hd.toml", "[MfNorm.cpu]\n[MfNorm]\ncpu.training = \"mf/fast\"\n"),
      "hd.toml:3:1: invalid TOML: Error while parsing key-value pair: cannot redefine existing table as "
      "dotted key-value pair");
  // An implicitly created table may be defined once by its own header.
  EXPECT_EQ(load_mapping_file(write("ok.toml", "[MfNorm.cpu]\ntraining = \"mf/fast\"\n[MfNorm]\n")).size(),
            1u);
}

TEST_F(MappingFile, TomlStringErrors) {
  EXPECT_EQ(
      error_of("u.toml", "[MfNorm]\ncpu = \"mf/fast\n"),
      "u.toml:2:15: invalid TOML: Error while parsing string: unescaped control characters other than TAB "
      "(U+0009) are explicitly prohibited");
  EXPECT_EQ(
      error_of("ul.toml", "[MfNorm]\ncpu = 'mf/fast\n"),
      "ul.toml:2:15: invalid TOML: Error while parsing literal string: control characters other than TAB "
      "(U+0009) are explicitly prohibited");
  EXPECT_EQ(error_of("e.toml", "[MfNorm]\ncpu = \"mf\\qfast\"\n"),
            "e.toml:2:11: invalid TOML: Error while parsing string: unknown escape sequence '\\q'");
  EXPECT_EQ(
      error_of("eu.toml", "[MfNorm]\ncpu = \"\\u12\"\n"),
      "eu.toml:2:12: invalid TOML: Error while parsing unicode scalar sequence: expected hex digit, saw "
      "'\"'");
  EXPECT_EQ(
      error_of("es.toml", "[MfNorm]\ncpu = \"\\uD800\"\n"),
      "es.toml:2:14: invalid TOML: Error while parsing unicode scalar sequence: unicode surrogates (U+D800 "
      "- U+DFFF) are explicitly prohibited");
  EXPECT_EQ(
      error_of("c.toml", "[MfNorm]\ncpu = \"mf\x01\"\n"),
      "c.toml:2:10: invalid TOML: Error while parsing string: unescaped control characters other than TAB "
      "(U+0009) are explicitly prohibited");
  EXPECT_EQ(error_of("utf.toml", "[MfNorm]\n# caf\xC3\xA9 \xFF\n"),
            "utf.toml:2:7: invalid TOML: Encountered invalid utf-8 sequence");
  // Columns count characters: 'é' is one.
  EXPECT_THAT(
      error_of("col.toml", "[MfNorm]\ncpu = { \"\xC3\xA9\xC3\xA9\" = \"mf/fast\", x = \"mf/fast\" }\n"),
      HasSubstr("\ncol.toml:2:27: unknown mode 'x' "));
}

// Everything TOML has parses (the TOML subset kernmap read before toml++ refused arrays, arrays of tables,
// multi-line strings, floats, dates and non-decimal integers by name); the shape check then names what a
// construct is where a kernel name or a table belongs.
TEST_F(MappingFile, TomlValuesOutsideTheShapeAreNamed) {
  EXPECT_EQ(
      error_of("a.toml", "[MfNorm]\ncpu = [\"mf/fast\"]\n"),
      "a.toml:2:7: device 'cpu' of layer 'MfNorm' must map to a kernel name (a string) or a table {mode: "
      "kernel}, got an array");
  EXPECT_EQ(
      error_of("aot.toml", "[[MfNorm]]\n"),
      "aot.toml:1:1: layer 'MfNorm' must map to a table of devices ({device: kernel} or {device: {mode: "
      "kernel}}), got an array");
  EXPECT_EQ(error_of("d.toml", "[MfNorm.cpu]\ntraining = 1979-05-27T07:32:00Z\n"),
            "d.toml:2:12: mode 'training' of layer 'MfNorm' on device 'cpu' must map to a kernel name (a "
            "string), got a date-time");
  EXPECT_EQ(
      error_of("dd.toml", "[MfNorm]\ncpu = 1979-05-27\n"),
      "dd.toml:2:7: device 'cpu' of layer 'MfNorm' must map to a kernel name (a string) or a table {mode: "
      "kernel}, got a date");
  EXPECT_EQ(
      error_of("tt.toml", "MfNorm = 07:32:00\n"),
      "tt.toml:1:10: layer 'MfNorm' must map to a table of devices ({device: kernel} or {device: {mode: "
      "kernel}}), got a time");
  EXPECT_EQ(error_of("f.toml", "kernmap_mapping = 1.0\n"),
            "f.toml:1:19: kernmap_mapping must be an integer (the format version, 1), got a float");
  EXPECT_EQ(error_of("h.toml", "kernmap_mapping = 0x2\n"),
            "h.toml:1:19: mapping file format version 2 is not supported (this kernmap reads version 1)");
  // Multi-line strings (a line-ending backslash joins lines) and non-decimal integers are ordinary values.
  EXPECT_EQ(load_mapping_file(write("ml.toml",
                                    "kernmap_mapping = 0x1\n[MfNorm.cpu]\ntraining = \"\"\"mf/fast\"\"\"\n"
                                    "inference = '''mf/slow'''\n[MfAct]\ncpu = \"\"\"mf/\\\n  act\"\"\"\n"
                                    "cuda.\"training+compile\" = \"\"\"\nmf/act\"\"\"\n")),
            kExpected);
}

TEST_F(MappingFile, TomlUnsupportedConstructsAreNamed) {
  EXPECT_EQ(error_of("b.toml", "[MfNorm]\ncpu = mf\n"),
            "b.toml:2:7: invalid TOML: Error while parsing value: could not determine value type");
  EXPECT_EQ(
      error_of("tc.toml", "MfNorm = { cpu = \"mf/fast\", }\n"),
      "tc.toml:1:29: invalid TOML: Error while parsing inline table: expected key-value pair, saw closing "
      "'}' (dangling comma)");
  EXPECT_EQ(error_of("nl.toml", "MfNorm = { cpu = \"mf/fast\",\n cuda = \"mf/fast\" }\n"),
            "nl.toml:1:28: invalid TOML: Error while parsing inline table: expected key or closing '}', saw "
            "'\\n'");
  EXPECT_EQ(error_of("eq.toml", "[MfNorm]\ncpu \"mf/fast\"\n"),
            "eq.toml:2:5: invalid TOML: Error while parsing key-value pair: expected '=', saw '\"'");
  EXPECT_EQ(error_of("hdr.toml", "[MfNorm\ncpu = \"mf/fast\"\n"),
            "hdr.toml:1:8: invalid TOML: Error while parsing table header: expected ']', saw '\\n'");
  EXPECT_EQ(
      error_of("eol.toml", "[MfNorm]\ncpu = \"mf/fast\" \"x\"\n"),
      "eol.toml:2:17: invalid TOML: Error while parsing key-value pair: expected a comment or whitespace, "
      "saw '\"'");
  EXPECT_EQ(
      error_of("cr.toml", "[MfNorm]\rcpu = \"mf/fast\"\n"),
      "cr.toml:1:10: invalid TOML: Error while parsing table header: expected '\\n' after '\\r', saw 'c'");
  EXPECT_EQ(error_of("nv.toml", "[MfNorm]\ncpu =\n"),
            "nv.toml:2:6: invalid TOML: Error while parsing key-value pair: expected value, saw '\\n'");
  // A header whose key does not start like one: toml++ 3.3 reaches its key parser there with a broken
  // precondition (see mapping_file/toml.cpp), and reports it. An array element that starts a line is no
  // header.
  EXPECT_EQ(
      error_of("h3.toml", "[[[MfNorm]]]\n"),
      "h3.toml:1:3: invalid TOML: Error while parsing key: expected bare key starting character or string "
      "delimiter, saw '['");
  EXPECT_EQ(
      error_of("h4.toml", "kernmap_mapping = 1\n  [ =]\n"),
      "h4.toml:2:5: invalid TOML: Error while parsing key: expected bare key starting character or string "
      "delimiter, saw '='");
  EXPECT_EQ(
      error_of("h6.toml", "[[\n"),
      "h6.toml:1:3: invalid TOML: Error while parsing key: expected bare key starting character or string "
      "delimiter, saw '\\n'");
  // Characters other than ASCII outside strings and comments are not TOML, and toml++ 3.3 would test them
  // with an undefined whitespace classification, as it would the first after a backslash in a multi-line
  // string.
  EXPECT_EQ(
      error_of("na.toml", "# caf\xC3\xA9\n[MfNorm]\ncpu\xC2\xA7 = \"mf/slow\"\n"),
      "na.toml:3:4: invalid TOML: '\xC2\xA7' (U+00A7) outside strings and comments (keys and values other "
      "than strings are ASCII)");
  EXPECT_EQ(error_of("nb.toml", "MfNorm.cpu = 1\xFF\n"),
            "nb.toml:1:15: invalid TOML: byte 0xFF outside strings and comments (keys and values other than "
            "strings are ASCII)");
  const std::string after_backslash =
      " after a backslash in a multi-line string: kernmap's TOML reader (toml++ 3.3) cannot take it there "
      "(write "
      "it as a \\u escape)";
  EXPECT_EQ(error_of("nc.toml", "[MfNorm]\ncpu = \"\"\"mf/\\\n   \xC2\xA7\"\"\"\n"),
            "nc.toml:3:4: '\xC2\xA7' (U+00A7)" + after_backslash);
  EXPECT_EQ(error_of("nd.toml", "[MfNorm]\ncpu = \"\"\"mf/\\\xC3\xA9\"\"\"\n"),
            "nd.toml:2:14: '\xC3\xA9' (U+00E9)" + after_backslash);
  EXPECT_THAT(error_of("ne.toml",
                       "[MfNorm] # \xC3\xA9\ncpu = \"mf/\xC3\xA9\" # \xC3\xA9\ncuda = '''\\\n\xC3\xA9'''\n"),
              StartsWith("ne.toml:2:7: unknown kernel 'mf/\xC3\xA9' for layer 'MfNorm' on device 'cpu' "));
  // In a value, a quote glued to a word is part of the word for toml++ (it reads to the next blank): what
  // follows is outside strings. In a key, a quote after a dot starts a quoted part.
  EXPECT_EQ(
      error_of("nf.toml", "MfNorm = 1979a.\"\"\"\xC3\xA9\"\"\"\n"),
      "nf.toml:1:19: invalid TOML: '\xC3\xA9' (U+00E9) outside strings and comments (keys and values other "
      "than strings are ASCII)");
  EXPECT_THAT(error_of("ng.toml", "MfNorm.\"c\xC3\xA9\" = \"mf/fast\"\n"),
              StartsWith("ng.toml:1:8: unknown device 'c\xC3\xA9' for layer 'MfNorm' ("));
  EXPECT_EQ(error_of("nh.toml", "MfAct = [ \"\xC3\xA9\",\"\xC3\xA9\", {a.\"\xC3\xA9\" = 1} ]\n"),
            "nh.toml:1:9: layer 'MfAct' must map to a table of devices ({device: kernel} or {device: {mode: "
            "kernel}}), got an array");
  EXPECT_EQ(
      error_of("h7.toml", "MfNorm = [\n[ { cpu = \"mf/fast\" } ],\n]\n"),
      "h7.toml:1:10: layer 'MfNorm' must map to a table of devices ({device: kernel} or {device: {mode: "
      "kernel}}), got an array");
}

TEST_F(MappingFile, HugeAndDeepInputIsRefusedCleanly) {
  const std::string big = "# " + std::string(1 << 20, 'x') + "\n";
  EXPECT_THAT(error_of("big.toml", big),
              HasSubstr("big.toml: the file is larger than the 1048576-byte limit"));
  EXPECT_EQ(error_of("deep.json", std::string(100000, '[') + std::string(100000, ']')),
            "deep.json: /0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0: nested deeper than 16 levels");
  std::string deep_toml = "x = ";
  for (int i = 0; i < 100000; ++i) deep_toml += "{a = ";
  EXPECT_EQ(
      error_of("deep.toml", deep_toml),
      "deep.toml:1:85: invalid TOML: Error while parsing value: exceeded maximum nested value depth of 16 "
      "(TOML_MAX_NESTED_VALUES)");
  // 17 tables deep (the root is the first): refused at the key of the 17th.
  std::string dotted = "x";
  for (int i = 0; i < 20; ++i) dotted += ".a";
  EXPECT_EQ(error_of("dotted.toml", dotted + " = \"k\"\n"), "dotted.toml:1:31: nested deeper than 16 levels");
  EXPECT_EQ(error_of("header.toml", std::string("[") + dotted + "]\n"),
            "header.toml:1:32: nested deeper than 16 levels");
  // A key of hundreds of thousands of parts would exhaust the stack inside toml++: refused before it parses.
  std::string very_deep = "x";
  for (int i = 0; i < 400000; ++i) very_deep += ".a";
  const std::string dots_message =
      "more than 64 dots outside strings and comments on one line (mapping files nest 16 levels at most)";
  EXPECT_EQ(error_of("very_deep.toml", std::string("[MfNorm]\n") + very_deep + " = \"k\"\n"),
            "very_deep.toml:2:130: " + dots_message);
  EXPECT_EQ(error_of("very_deep_header.toml", std::string("# .\n[") + very_deep + "]\n"),
            "very_deep_header.toml:2:131: " + dots_message);
  // Dots in comments and strings (multi-line ones too, across lines) are not keys.
  const std::string dots(1000, '.');
  EXPECT_THAT(
      error_of("dots.toml", std::string("# ") + dots + "\n[MfNorm.cpu]\ntraining = \"" + dots + "\" # " +
                                dots + "\ninference = '''\n" + dots + "\n" + dots + "'''\n"),
      StartsWith("dots.toml:3:12: unknown kernel '" + dots + "'"));
  std::string wide = "{\"MfNorm\": {";
  for (int i = 0; i < 70000; ++i) wide += (i ? ",\"" : "\"") + std::to_string(i) + "\":1";
  EXPECT_EQ(error_of("wide.json", wide + "}}"), "wide.json: /MfNorm: more than 65536 values in one file");
  std::string wide_toml = "[MfNorm]\n";
  for (int i = 100000; i < 170000; ++i) wide_toml.append("k").append(std::to_string(i)).append(" = 1\n");
  EXPECT_EQ(error_of("wide.toml", wide_toml),
            "wide.toml:65536:11: more than 65536 values in one file (the limit for mapping files)");
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
