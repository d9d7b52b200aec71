// C API tests: the registry through include/kernmap/c_api.h (JSON in and out, status codes, no exceptions),
// seen by the C++ registry and the reverse.
#include <nlohmann/json.hpp>

#include <cstring>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "kernmap/c_api.h"
#include "kernmap/cpu.h"
#include "kernmap/registry.h"

namespace {

using nlohmann::json;

// Owns a string returned by the library.
struct Text {
  char* p = nullptr;
  ~Text() { kernmap_free(p); }
  std::string str() const { return p ? std::string(p) : std::string(); }
};

int rejects_rank_one(void* user_data, const char* inputs_json, char* reason, size_t capacity) {
  ++*static_cast<int*>(user_data);
  const json inputs = json::parse(inputs_json);
  for (const auto& shape : inputs.at("shapes")) {
    if (shape.size() == 1) {
      std::strncpy(reason, "capi rank-1 input", capacity);
      return 0;
    }
  }
  return 1;
}

int g_supports_calls = 0;

void register_once() {
  static const bool done = [] {
    kernmap::KernelDescriptor reference;
    reference.name = "reference/capi_norm";
    reference.layer = "CapiNorm";
    reference.devices = {"*"};
    reference.dtypes = {"float32", "bfloat16"};
    reference.has_backward = true;
    kernmap::register_kernel(reference);
    Text error;
    const std::string d = json{{"name", "capi/norm"},   {"layer", "CapiNorm"},   {"devices", {"cpu"}},
                               {"dtypes", {"float32"}}, {"has_backward", false}, {"compile_safe", true}}
                              .dump();
    EXPECT_EQ(kernmap_register_kernel(d.c_str(), rejects_rank_one, &g_supports_calls, &error.p), KERNMAP_OK)
        << error.str();
    return true;
  }();
  (void)done;
}

json resolve(const json& request) {
  Text out, error;
  EXPECT_EQ(kernmap_resolve(request.dump().c_str(), &out.p, &error.p), KERNMAP_OK) << error.str();
  return json::parse(out.str());
}

TEST(CApi, VersionMatchesHeader) {
  EXPECT_EQ(kernmap_c_api_version(), KERNMAP_C_API_VERSION);
}

TEST(CApi, KernelRegisteredThroughCIsSeenByCpp) {
  register_once();
  const kernmap::KernelDescriptor* d = kernmap::find_kernel("capi/norm");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->layer, "CapiNorm");
  EXPECT_FALSE(d->has_backward);
  EXPECT_EQ(d->op, "");
  Text list, error;
  ASSERT_EQ(kernmap_list_kernels(&list.p, &error.p), KERNMAP_OK);
  bool found = false;
  for (const auto& k : json::parse(list.str()))
    found |= k.at("name") == "capi/norm" && k.at("provider") == "capi";
  EXPECT_TRUE(found);
}

TEST(CApi, MappingRegisteredThroughCResolvesInCppAndTheReverse) {
  register_once();
  Text error;
  ASSERT_EQ(kernmap_register_mapping(R"({"CapiNorm": {"cpu": {"inference": "capi/norm"}}})", &error.p),
            KERNMAP_OK)
      << error.str();
  EXPECT_EQ(kernmap::resolve("CapiNorm", "cpu", kernmap::Mode::kInference).kernel->name, "capi/norm");
  const json d =
      resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "inference"}, {"dtype", "float32"}});
  EXPECT_EQ(d.at("kernel"), "capi/norm");
  EXPECT_EQ(d.at("fallback"), false);
  EXPECT_EQ(d.at("source"), "user");

  kernmap::register_mapping({{"CapiNorm", {{"xpu", {{kernmap::Mode::kFallback, "capi/norm"}}}}}});
  const json x = resolve({{"layer", "CapiNorm"}, {"device", "xpu"}, {"mode", "inference"}});
  EXPECT_EQ(x.at("kernel"), "reference/capi_norm");
  EXPECT_EQ(x.at("reason"), "capi/norm does not run on xpu");
  kernmap::clear_user_mappings();
}

TEST(CApi, ReasonsForDtypeBackwardAndSupports) {
  register_once();
  Text error;
  ASSERT_EQ(kernmap_register_mapping(R"({"CapiNorm": {"cpu": {"fallback": "capi/norm"}}})", &error.p),
            KERNMAP_OK);
  EXPECT_EQ(resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "inference"}, {"dtype", "bfloat16"}})
                .at("reason"),
            "dtype bfloat16 not supported by capi/norm");
  EXPECT_EQ(resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "training"}}).at("reason"),
            "capi/norm has no backward");
  const int before = g_supports_calls;
  EXPECT_EQ(resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "inference"}, {"shapes", {{4}}}})
                .at("reason"),
            "capi rank-1 input");
  EXPECT_EQ(resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "inference"}, {"shapes", {{2, 4}}}})
                .at("kernel"),
            "capi/norm");
  EXPECT_EQ(g_supports_calls, before + 2);
  ASSERT_EQ(kernmap_clear_user_mappings(&error.p), KERNMAP_OK);
}

TEST(CApi, ScopesArePerThreadAndEndByHandle) {
  register_once();
  uint64_t handle = 0;
  Text error;
  ASSERT_EQ(kernmap_push_scope(R"({"CapiNorm": {"cpu": {"inference": "capi/norm"}}})", 1, &handle, &error.p),
            KERNMAP_OK)
      << error.str();
  EXPECT_EQ(resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "inference"}}).at("source"),
            "scoped");
  std::string other_thread;
  std::thread([&] {
    other_thread = kernmap::resolve("CapiNorm", "cpu", kernmap::Mode::kInference).source;
  }).join();
  EXPECT_EQ(other_thread, "reference");
  ASSERT_EQ(kernmap_pop_scope(handle, &error.p), KERNMAP_OK);
  EXPECT_EQ(resolve({{"layer", "CapiNorm"}, {"device", "cpu"}, {"mode", "inference"}}).at("source"),
            "reference");
  Text again;
  EXPECT_EQ(kernmap_pop_scope(handle, &again.p), KERNMAP_INVALID_ARGUMENT);
  EXPECT_NE(again.str().find("is not an open scope"), std::string::npos);
}

TEST(CApi, ErrorsAreMessagesNotExceptions) {
  register_once();
  Text e1, e2, e3, e4, out;
  EXPECT_EQ(kernmap_register_mapping("{not json", &e1.p), KERNMAP_INVALID_ARGUMENT);
  EXPECT_NE(e1.str().find("invalid JSON"), std::string::npos) << e1.str();
  EXPECT_EQ(kernmap_register_mapping(R"({"NoSuchLayer": {"cpu": {"training": "capi/norm"}}})", &e2.p),
            KERNMAP_INVALID_ARGUMENT);
  EXPECT_NE(e2.str().find("unknown layer 'NoSuchLayer'"), std::string::npos) << e2.str();
  EXPECT_EQ(kernmap_register_mapping(R"({"CapiNorm": {"cpu": {"sometimes": "capi/norm"}}})", &e3.p),
            KERNMAP_INVALID_ARGUMENT);
  EXPECT_NE(e3.str().find("'sometimes'"), std::string::npos) << e3.str();
  EXPECT_EQ(kernmap_register_kernel(R"({"name": "capi/norm", "layer": "CapiNorm"})", nullptr, nullptr, &e4.p),
            KERNMAP_INVALID_ARGUMENT);
  EXPECT_FALSE(e4.str().empty());
  Text e5;
  EXPECT_EQ(kernmap_resolve(R"({"layer": "CapiNorm"})", &out.p, &e5.p), KERNMAP_INVALID_ARGUMENT);
  EXPECT_EQ(out.p, nullptr);
}

TEST(CApi, CpuLevelsAreReadAndSet) {
  Text levels, e1, e2, e3;
  ASSERT_EQ(kernmap_cpu_levels(&levels.p, &e1.p), KERNMAP_OK) << e1.str();
  const json j = json::parse(levels.str());
  const auto supported = j.at("supported").get<std::vector<std::string>>();
  EXPECT_EQ(supported, kernmap::supported_cpu_levels());
  EXPECT_EQ(j.at("level").get<std::string>(), kernmap::cpu_level());
  const std::string before = kernmap::cpu_level();
  ASSERT_EQ(kernmap_set_cpu_level("baseline", &e2.p), KERNMAP_OK) << e2.str();
  EXPECT_EQ(kernmap::cpu_level(), "baseline");
  EXPECT_EQ(kernmap_set_cpu_level("sse9", &e3.p), KERNMAP_INVALID_ARGUMENT);
  EXPECT_NE(e3.str().find("unknown level 'sse9' (this CPU runs: baseline"), std::string::npos) << e3.str();
  Text e4, e5;
  EXPECT_EQ(kernmap_set_cpu_level(nullptr, &e4.p), KERNMAP_INVALID_ARGUMENT);
  EXPECT_NE(e4.str().find("level is NULL"), std::string::npos) << e4.str();
  kernmap::set_cpu_level(before);
  EXPECT_EQ(kernmap_cpu_levels(nullptr, &e5.p), KERNMAP_INVALID_ARGUMENT);
}

}  // namespace
