// Hugging Face checkpoints: safetensors files (one, or shards listed in model.safetensors.index.json) read
// into and written from a model's parameters under their transformers names. Headers are validated by
// models/safetensors_format.cpp before any tensor data is touched; here names, shapes and dtypes are checked
// against the model that the config built, for every file, before any parameter is overwritten.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "kernmap/models.h"
#include "kernmap/safetensors.h"
#include "models/json_document.h"
#include "models/safetensors_format.h"
#include "repository/atomic_file.h"

namespace kernmap {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;
using Tensor = at::Tensor;

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::optional<at::ScalarType> scalar_type(st::Dtype d) {
  switch (d) {
    case st::Dtype::kBool:
      return at::kBool;
    case st::Dtype::kU8:
      return at::kByte;
    case st::Dtype::kI8:
      return at::kChar;
    case st::Dtype::kI16:
      return at::kShort;
    case st::Dtype::kI32:
      return at::kInt;
    case st::Dtype::kI64:
      return at::kLong;
    case st::Dtype::kF16:
      return at::kHalf;
    case st::Dtype::kBF16:
      return at::kBFloat16;
    case st::Dtype::kF32:
      return at::kFloat;
    case st::Dtype::kF64:
      return at::kDouble;
    case st::Dtype::kF8E5M2:
      return at::kFloat8_e5m2;
    case st::Dtype::kF8E4M3:
      return at::kFloat8_e4m3fn;
    case st::Dtype::kU16:
      return at::kUInt16;
    case st::Dtype::kU32:
      return at::kUInt32;
    case st::Dtype::kU64:
      return at::kUInt64;
  }
  return std::nullopt;
}

std::optional<st::Dtype> format_dtype(at::ScalarType t) {
  for (int d = 0; d <= static_cast<int>(st::Dtype::kU64); ++d)
    if (scalar_type(static_cast<st::Dtype>(d)) == t) return static_cast<st::Dtype>(d);
  return std::nullopt;
}

st::Dtype file_dtype(at::ScalarType t, const std::string& path, const std::string& name) {
  if (const std::optional<st::Dtype> d = format_dtype(t)) return *d;
  throw CheckpointError(path + ": tensor '" + name + "' has dtype " + c10::toString(t) +
                        ", which safetensors cannot store");
}

std::string shape_string(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// An open safetensors file with its validated header.
class File {
 public:
  explicit File(std::string path) : path_(std::move(path)), in_(path_, std::ios::binary) {
    std::error_code ec;
    if (!in_ || fs::is_directory(path_, ec)) throw CheckpointError(path_ + ": cannot open");
    const uint64_t size = fs::file_size(path_, ec);
    if (ec) throw CheckpointError(path_ + ": cannot read its size: " + ec.message());
    try {
      unsigned char first8[8] = {};
      in_.read(reinterpret_cast<char*>(first8), std::min<uint64_t>(size, 8));
      const uint64_t n = st::header_length(first8, size);
      std::string header(n, '\0');
      if (!in_.read(header.data(), static_cast<std::streamsize>(n)))
        throw st::FormatError("safetensors: short read of the header");
      header_ = st::parse_header(header, size);
    } catch (const st::FormatError& e) {
      throw CheckpointError(path_ + ": " + e.what());
    }
  }
  const std::string& path() const { return path_; }
  const st::Header& header() const { return header_; }

  // The tensor's data as a new CPU tensor of its file dtype.
  Tensor read(const st::TensorInfo& t) {
    const std::optional<at::ScalarType> type = scalar_type(t.dtype);
    Tensor out = at::empty(t.shape, at::TensorOptions().dtype(*type));
    const uint64_t bytes = t.end - t.begin;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(header_.data_start + t.begin));
    if (!in_.read(static_cast<char*>(out.data_ptr()), static_cast<std::streamsize>(bytes)))
      throw CheckpointError(path_ + ": tensor '" + t.name +
                            "': short read (the file changed while loading?)");
    return out;
  }

 private:
  std::string path_;
  std::ifstream in_;
  st::Header header_;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const std::string& path, std::string_view text) {
  try {
    repository::write_file_atomically(path, text);
  } catch (const repository::WriteError& e) {
    throw CheckpointError(e.what());
  }
}

// The shard of each tensor from model.safetensors.index.json. Shard names come from the file: only plain file
// names in the checkpoint folder are accepted.
std::map<std::string, std::string> read_index(const std::string& path) {
  nlohmann::json index;
  try {
    index = json_document::parse(read_text(path));
  } catch (const json_document::Error& e) {
    throw CheckpointError(path + ": not valid JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw CheckpointError(path + ": expected an object with a 'weight_map' object");
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      throw CheckpointError(path + ": weight_map['" + name + "'] must be a file name, got " + file.dump());
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f[0] == '.' ||
        !f.ends_with(".safetensors"))
      throw CheckpointError(path + ": weight_map['" + name + "'] = '" + f +
                            "' is not a .safetensors file name in the checkpoint folder");
    shard_of[name] = f;
  }
  return shard_of;
}

bool ignorable(const std::string& name, const ModelConfig& config) {
  // Tied checkpoints may still carry lm_head.weight (transformers re-ties it on load); old ones stored rotary
  // inv_freq buffers.
  return (config.tie_word_embeddings && name == "lm_head.weight") || name.ends_with("rotary_emb.inv_freq");
}

// Where the checkpoint stores a parameter. Experts weights are stored as transformers writes them (and as the
// Hub's Qwen MoE checkpoints hold them): one gate_proj, up_proj and down_proj matrix per expert, which
// transformers 5 stacks on load into gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]. The
// fused names are accepted on load as well.
struct Piece {
  std::string name;
  Tensor view;  // the part of the parameter this tensor fills
};
struct ParamLayout {
  std::string name;
  Tensor param;
  std::vector<Piece> pieces;  // empty: stored whole under name
};

std::vector<ParamLayout> checkpoint_layout(const torch::nn::Module& model) {
  std::set<std::string> experts;
  for (const auto& m : model.named_modules("", /*include_self=*/false))
    if (dynamic_cast<const Experts*>(m.value().get()) != nullptr) experts.insert(m.key());
  std::vector<ParamLayout> out;
  for (const auto& item : model.named_parameters()) {
    ParamLayout layout{item.key(), item.value(), {}};
    const std::string& name = item.key();
    const size_t dot = name.rfind('.');
    const std::string owner = dot == std::string::npos ? "" : name.substr(0, dot);
    const std::string leaf = name.substr(dot + 1);
    if (experts.count(owner)) {
      const Tensor& p = item.value();
      for (int64_t e = 0; e < p.size(0); ++e) {
        const std::string prefix = owner + "." + std::to_string(e) + ".";
        if (leaf == "gate_up_proj") {
          const int64_t I = p.size(1) / 2;
          layout.pieces.push_back({prefix + "gate_proj.weight", p[e].slice(0, 0, I)});
          layout.pieces.push_back({prefix + "up_proj.weight", p[e].slice(0, I, 2 * I)});
        } else {
          layout.pieces.push_back({prefix + "down_proj.weight", p[e]});
        }
      }
    }
    out.push_back(std::move(layout));
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> read_safetensors(const std::string& path) {
  File file(path);
  for (const st::TensorInfo& t : file.header().tensors)
    if (!scalar_type(t.dtype)) throw CheckpointError(path + ": tensor '" + t.name + "': dtype not supported");
  std::vector<std::pair<std::string, Tensor>> out;
  for (const st::TensorInfo& t : file.header().tensors) out.emplace_back(t.name, file.read(t));
  return out;
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  if (const std::optional<st::Dtype> d = format_dtype(dtype)) return std::string(st::dtype_name(*d));
  throw CheckpointError(std::string("dtype ") + c10::toString(dtype) + " has no safetensors name");
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<st::TensorToWrite> entries;
  for (const auto& [name, t] : tensors)
    entries.push_back({name, file_dtype(t.scalar_type(), path, name), t.sizes().vec()});
  std::string header;
  try {
    header = st::build_header(entries, metadata);
  } catch (const st::FormatError& e) {
    throw CheckpointError(path + ": " + e.what());
  }
  try {
    repository::AtomicFile out(path);
    out.write(header);
    for (const auto& [name, t] : tensors) {
      const Tensor data = t.detach().to(at::kCPU).contiguous();
      out.write(data.const_data_ptr(), data.nbytes());
    }
    out.commit();
  } catch (const repository::WriteError& e) {
    throw CheckpointError(e.what());
  }
}

void CausalLM::load_weights(const std::string& dir) {
  const std::vector<ParamLayout> layout = checkpoint_layout(*this);
  std::map<std::string, Tensor> slots;  // checkpoint tensor name -> where it goes
  for (const ParamLayout& p : layout) {
    slots.emplace(p.name, p.param);
    for (const Piece& piece : p.pieces) slots.emplace(piece.name, piece.view);
  }

  // Which files, and (sharded) which tensors each should hold.
  std::map<std::string, std::string> shard_of;
  std::vector<std::string> files;
  const bool sharded = fs::exists(dir + "/" + kIndexFile);
  if (sharded) {
    shard_of = read_index(dir + "/" + kIndexFile);
    std::set<std::string> unique;
    for (const auto& [_, f] : shard_of) unique.insert(f);
    files.assign(unique.begin(), unique.end());
  } else if (fs::exists(dir + "/" + kSingleFile)) {
    files = {kSingleFile};
  } else {
    throw CheckpointError(dir + ": no " + kSingleFile + " or " + kIndexFile);
  }

  // Pass 1: every header, name, shape and dtype, before any parameter changes.
  std::vector<std::unique_ptr<File>> opened;
  std::vector<std::pair<File*, const st::TensorInfo*>> plan;
  std::map<std::string, std::string> found;  // tensor -> file
  for (const std::string& f : files) {
    opened.push_back(std::make_unique<File>(dir + "/" + f));
    File& file = *opened.back();
    for (const st::TensorInfo& t : file.header().tensors) {
      const std::string where = file.path() + ": tensor '" + t.name + "'";
      if (sharded) {
        const auto it = shard_of.find(t.name);
        if (it == shard_of.end()) throw CheckpointError(where + " is not listed in " + kIndexFile);
        if (it->second != f)
          throw CheckpointError(where + " is listed in " + kIndexFile + " under " + it->second);
      }
      if (const auto dup = found.find(t.name); dup != found.end())
        throw CheckpointError(where + " is also in " + dup->second);
      found[t.name] = f;
      const auto slot = slots.find(t.name);
      if (slot == slots.end()) {
        if (ignorable(t.name, config_)) continue;
        throw CheckpointError(where + " is not a parameter of this " + config_.model_type +
                              " model (unexpected tensor; does config.json match the weights?)");
      }
      const std::optional<at::ScalarType> type = scalar_type(t.dtype);
      if (!type || !at::isFloatingType(*type))
        throw CheckpointError(where + " has dtype " + std::string(st::dtype_name(t.dtype)) +
                              "; a parameter needs F32, F16, BF16 or F64");
      if (c10::IntArrayRef(t.shape) != slot->second.sizes())
        throw CheckpointError(where + " has shape " + shape_string(t.shape) + ", but config.json gives " +
                              shape_string(slot->second.sizes()));
      plan.emplace_back(&file, &t);
    }
  }
  // Every parameter filled exactly once: whole, or from all its pieces.
  for (const ParamLayout& p : layout) {
    const bool whole = found.count(p.name) > 0;
    size_t pieces = 0;
    const Piece* first_missing = nullptr;
    for (const Piece& piece : p.pieces) {
      if (found.count(piece.name)) {
        ++pieces;
      } else if (first_missing == nullptr) {
        first_missing = &piece;
      }
    }
    if (whole && pieces > 0)
      throw CheckpointError(dir + ": tensor '" + p.name + "' is stored both whole and per expert");
    if (whole || (!p.pieces.empty() && pieces == p.pieces.size())) continue;
    const std::string name = first_missing != nullptr && pieces > 0 ? first_missing->name : p.name;
    std::string what = dir + ": missing tensor '" + name + "'";
    if (!p.pieces.empty() && pieces == 0)
      what += " (or its per-expert tensors '" + p.pieces.front().name + "', ...)";
    if (sharded && shard_of.count(name))
      what += " (" + std::string(kIndexFile) + " lists it in " + shard_of[name] + ", which lacks it)";
    throw CheckpointError(what);
  }

  // Pass 2: the data, converted to each parameter's dtype and device.
  at::NoGradGuard no_grad;
  for (const auto& [file, info] : plan) slots.at(info->name).copy_(file->read(*info));
}

void CausalLM::save_pretrained(const std::string& dir, uint64_t max_shard_bytes) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw CheckpointError(dir + ": cannot create: " + ec.message());

  at::NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> params;
  for (const ParamLayout& p : checkpoint_layout(*this)) {
    if (p.pieces.empty()) params.emplace_back(p.name, p.param);
    for (const Piece& piece : p.pieces) params.emplace_back(piece.name, piece.view);
  }
  ModelConfig config = config_;
  if (!params.empty()) {
    const at::ScalarType t = params.front().second.scalar_type();
    config.dtype = t == at::kBFloat16 ? "bfloat16"
                   : t == at::kHalf   ? "float16"
                   : t == at::kDouble ? "float64"
                                      : "float32";
  }
  write_text(dir + "/config.json", config.to_json());

  // Shards as transformers cuts them: a new shard when the next tensor would exceed the limit.
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  uint64_t shard_bytes = 0, total = 0;
  for (auto& p : params) {
    const uint64_t bytes = p.second.nbytes();
    if (max_shard_bytes > 0 && shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(p);
    shard_bytes += bytes;
    total += bytes;
  }
  fs::remove(dir + "/" + kIndexFile, ec);
  if (shards.size() == 1) {
    write_safetensors(dir + "/" + kSingleFile, shards.front());
    return;
  }
  fs::remove(dir + "/" + kSingleFile, ec);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  char name[64];
  for (size_t i = 0; i < shards.size(); ++i) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    write_safetensors(dir + "/" + name, shards[i]);
    for (const auto& p : shards[i]) weight_map[p.first] = name;
  }
  const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text(dir + "/" + kIndexFile, index.dump(2) + "\n");
}

}  // namespace kernmap
