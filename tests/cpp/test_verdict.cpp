// The align verdict (train/verdict.cpp) on the cases tests/python/test_verdict.py checks the Python one with:
// one definition, two implementations, the same answers.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernmap/train.h"

namespace {

using nlohmann::json;

double value(const json& v) {
  return v.is_string() ? std::stod(v.get<std::string>()) : v.get<double>();
}

std::vector<double> values(const json& array) {
  std::vector<double> out;
  for (const json& v : array) out.push_back(value(v));
  return out;
}

std::vector<json> cases() {
  std::ifstream in(KERNMAP_TEST_DATA_DIR "/verdict_cases.json");
  const json doc = json::parse(in);
  return doc.at("cases").get<std::vector<json>>();
}

void expect_near_rel(double got, double want, const std::string& what) {
  if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  EXPECT_NEAR(got, want, 1e-6 * std::abs(want) + 1e-12) << what;
}

class SharedCase : public ::testing::TestWithParam<json> {};

TEST_P(SharedCase, BothMetricsAsExpected) {
  const json& c = GetParam();
  const double rtol = c.at("rtol"), factor = c.at("noise_factor");
  bool passed = true;
  for (const char* metric : {"loss", "grad_norm"}) {
    std::vector<std::vector<double>> noise;
    for (const json& run : c.at("noise")) noise.push_back(values(run[metric]));
    const kernmap::train::MetricVerdict v = kernmap::train::judge_metric(
        values(c["original"][metric]), values(c["kernelized"][metric]), noise, rtol, factor);
    const json& want = c["expect"][metric];
    EXPECT_EQ(v.passed, want.at("passed").get<bool>()) << metric;
    const std::vector<double> diff = values(want.at("diff")), tol = values(want.at("tolerance"));
    ASSERT_EQ(v.diff.size(), diff.size());
    for (size_t s = 0; s < diff.size(); ++s) {
      expect_near_rel(v.diff[s], diff[s], std::string(metric) + " diff at step " + std::to_string(s + 1));
      expect_near_rel(v.tolerance[s], tol[s],
                      std::string(metric) + " tolerance at step " + std::to_string(s + 1));
      if (s > 0) {
        EXPECT_GE(v.floor[s], v.floor[s - 1]) << "the floor never falls";
      }
    }
    EXPECT_EQ(v.max_diff_step, want.at("max_diff_step").get<int64_t>()) << metric;
    EXPECT_EQ(v.worst_step, want.at("worst_step").get<int64_t>()) << metric;
    passed = passed && v.passed;
  }
  EXPECT_EQ(passed, c["expect"].at("passed").get<bool>());
}

INSTANTIATE_TEST_SUITE_P(Cases, SharedCase, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<json>& info) {
                           std::string name;
                           for (char ch : info.param.at("name").get<std::string>())
                             name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return name;
                         });

TEST(Verdict, RunsOfDifferentLengthsAreAnError) {
  try {
    kernmap::train::judge_metric({1, 1}, {1}, {{1, 1}}, 1e-5);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("same number of steps, got original 2, kernelized 1, noise 2"),
              std::string::npos)
        << e.what();
  }
  try {
    kernmap::train::judge_metric({1, 1}, {1, 1}, {{1, 1}, {1, 1, 1}}, 1e-5);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("same number of steps, got original 2, kernelized 2, noise 3"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
