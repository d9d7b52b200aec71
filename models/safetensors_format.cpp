// safetensors header parsing and validation (torch-free; see safetensors_format.h). Every number read from
// the file is checked before it is used in arithmetic, and all arithmetic on such numbers is
// overflow-checked.
#include "models/safetensors_format.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "models/json_document.h"

namespace kernmap::safetensors {
namespace {

using nlohmann::json;

// A safetensors header is three levels deep (object -> tensor entry -> shape list); anything much deeper is
// not a safetensors header, and deep nesting is how a hostile header would try to exhaust the parser.
constexpr int kMaxDepth = 8;

constexpr std::array<std::pair<std::string_view, Dtype>, 15> kDtypes = {{
    {"BOOL", Dtype::kBool},
    {"U8", Dtype::kU8},
    {"I8", Dtype::kI8},
    {"F8_E5M2", Dtype::kF8E5M2},
    {"F8_E4M3", Dtype::kF8E4M3},
    {"I16", Dtype::kI16},
    {"U16", Dtype::kU16},
    {"F16", Dtype::kF16},
    {"BF16", Dtype::kBF16},
    {"I32", Dtype::kI32},
    {"U32", Dtype::kU32},
    {"F32", Dtype::kF32},
    {"F64", Dtype::kF64},
    {"I64", Dtype::kI64},
    {"U64", Dtype::kU64},
}};

[[noreturn]] void fail(const std::string& what) {
  throw FormatError("safetensors: " + what);
}
[[noreturn]] void fail_tensor(const std::string& name, const std::string& what) {
  fail("tensor '" + name + "': " + what);
}

// Offset of the first byte that is not part of a well-formed UTF-8 sequence (overlong forms, surrogates and
// code points above U+10FFFF are ill-formed), or npos.
size_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t j = 2; j < len; ++j)
      if (p[i + j] < 0x80 || p[i + j] > 0xBF) return i;
    i += len;
  }
  return std::string_view::npos;
}

json parse_json(std::string_view text) {
  // The callback sees every key as it is parsed: nlohmann keeps the last of duplicate keys silently, so
  // duplicates (two tensors of one name) are caught here, as is nesting beyond kMaxDepth.
  std::vector<std::set<std::string>> keys;
  const json::parser_callback_t guard = [&keys](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth) fail("header JSON is nested deeper than " + std::to_string(kMaxDepth) + " levels");
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
          fail("header JSON has the key '" + parsed.get<std::string>() + "' twice in one object");
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json_document::parse(text, guard);
  } catch (const json_document::Error& e) {
    fail(std::string("header is not valid JSON: ") + e.what());
  }
}

Dtype parse_dtype(const std::string& name, const json& value) {
  if (!value.is_string()) fail_tensor(name, "dtype must be a string, got " + value.dump());
  const auto text = value.get<std::string>();
  for (const auto& [n, d] : kDtypes)
    if (n == text) return d;
  fail_tensor(name, "unknown dtype '" + text + "'");
}

uint64_t checked_uint(const std::string& name, const char* field, const json& value) {
  if (!value.is_number_unsigned())
    fail_tensor(name, std::string(field) + " must hold non-negative integers, got " + value.dump());
  return value.get<uint64_t>();
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t buffer_size) {
  if (name.empty()) fail("a tensor has an empty name");
  if (!entry.is_object()) fail_tensor(name, "entry must be an object, got " + entry.dump());
  for (const auto& [key, _] : entry.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail_tensor(name, "unexpected key '" + key + "'");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(key)) fail_tensor(name, std::string("missing '") + key + "'");

  TensorInfo info;
  info.name = name;
  info.dtype = parse_dtype(name, entry["dtype"]);
  const json& shape = entry["shape"];
  if (!shape.is_array()) fail_tensor(name, "shape must be a list, got " + shape.dump());
  uint64_t numel = 1;
  for (const json& d : shape) {
    const uint64_t dim = checked_uint(name, "shape", d);
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(numel, dim, &numel))
      fail_tensor(name, "shape " + shape.dump() + " has more elements than fit in 64 bits");
    info.shape.push_back(static_cast<int64_t>(dim));
  }
  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    fail_tensor(name, "data_offsets must be [begin, end], got " + offsets.dump());
  info.begin = checked_uint(name, "data_offsets", offsets[0]);
  info.end = checked_uint(name, "data_offsets", offsets[1]);
  if (info.end < info.begin)
    fail_tensor(name, "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                          "] end before they begin");
  if (info.end > buffer_size)
    fail_tensor(name, "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                          "] reach past the data buffer of " + std::to_string(buffer_size) +
                          " bytes (file truncated?)");
  uint64_t bytes = 0;
  const bool overflow = __builtin_mul_overflow(numel, dtype_size(info.dtype), &bytes);
  if (overflow || bytes != info.end - info.begin)
    fail_tensor(name, "shape " + shape.dump() + " of " + std::string(dtype_name(info.dtype)) + " needs " +
                          (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                          " bytes, but data_offsets span " + std::to_string(info.end - info.begin));
  return info;
}

}  // namespace

size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::kBool:
    case Dtype::kU8:
    case Dtype::kI8:
    case Dtype::kF8E5M2:
    case Dtype::kF8E4M3:
      return 1;
    case Dtype::kI16:
    case Dtype::kU16:
    case Dtype::kF16:
    case Dtype::kBF16:
      return 2;
    case Dtype::kI32:
    case Dtype::kU32:
    case Dtype::kF32:
      return 4;
    case Dtype::kF64:
    case Dtype::kI64:
    case Dtype::kU64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(Dtype dtype) {
  for (const auto& [n, d] : kDtypes)
    if (d == dtype) return n;
  return "?";
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

const TensorInfo* Header::find(std::string_view name) const {
  for (const TensorInfo& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

uint64_t header_length(const unsigned char* first8, uint64_t file_size) {
  if (file_size < 8)
    fail("file of " + std::to_string(file_size) + " bytes is too short for the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  if (n == 0) fail("header length is 0");
  if (n > kMaxHeaderBytes)
    fail("header length " + std::to_string(n) + " exceeds the limit of " + std::to_string(kMaxHeaderBytes) +
         " bytes");
  if (n > file_size - 8)
    fail("header length " + std::to_string(n) + " reaches past the end of the file (" +
         std::to_string(file_size) + " bytes)");
  return n;
}

Header parse_header(std::string_view text, uint64_t file_size) {
  if (text.size() > file_size || file_size - text.size() < 8)
    fail("header of " + std::to_string(text.size()) + " bytes does not fit a file of " +
         std::to_string(file_size) + " bytes");
  if (const size_t bad = invalid_utf8_at(text); bad != std::string_view::npos)
    fail("header is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  const json root = parse_json(text);
  if (!root.is_object()) fail("header must be a JSON object, got a " + std::string(root.type_name()));

  Header header;
  header.data_start = 8 + text.size();
  const uint64_t buffer_size = file_size - header.data_start;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("__metadata__ must be an object of strings, got " + entry.dump());
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) fail("__metadata__ '" + key + "' must be a string, got " + value.dump());
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    header.tensors.push_back(parse_entry(name, entry, buffer_size));
  }

  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : header.tensors) {
    if (t.begin < cursor)
      fail_tensor(t.name, "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                              "] overlap tensor '" + previous->name + "' (ends at " + std::to_string(cursor) +
                              ")");
    if (t.begin > cursor)
      fail_tensor(t.name, "data_offsets begin at " + std::to_string(t.begin) + ", leaving bytes " +
                              std::to_string(cursor) + ".." + std::to_string(t.begin) +
                              " of the data buffer unused");
    cursor = t.end;
    previous = &t;
  }
  if (cursor != buffer_size)
    fail("the tensors cover " + std::to_string(cursor) + " bytes of the " + std::to_string(buffer_size) +
         "-byte data buffer (extra or missing bytes at the end of the file)");
  return header;
}

Header parse_file(const unsigned char* data, uint64_t size) {
  const uint64_t n = header_length(data, size);
  return parse_header(std::string_view(reinterpret_cast<const char*>(data) + 8, n), size);
}

std::string build_header(const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps the data order of the tensors in the header, which is how other writers lay it out.
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  if (!metadata.empty()) root["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") fail("cannot write a tensor named '" + t.name + "'");
    if (!names.insert(t.name).second) fail_tensor(t.name, "written twice");
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) fail_tensor(t.name, "negative dimension");
      bytes *= static_cast<uint64_t>(d);
    }
    root[t.name] = {
        {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = root.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + text;
}

}  // namespace kernmap::safetensors
