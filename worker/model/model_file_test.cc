#include "worker/model/model_file.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/framed_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

using ::testing::HasSubstr;

std::string Path(const std::string& name) { return ::testing::TempDir() + "/" + name; }

TEST(ModelFileTest, RoundTripsTheSpecTensorsAndWhereTheyCameFrom) {
  const ModelSpec spec = *ParseModelSpec("mlp:784-32-10");
  std::vector<std::vector<float>> params = InitModelParams(spec, 7);
  params[0][0] = -0.0f;
  params[1][0] = std::numeric_limits<float>::denorm_min();
  ModelFile about;
  about.set_steps(123);
  about.set_mode("ssp:2");
  about.set_test_accuracy(0.8125);
  ASSERT_TRUE(ExportModel(Path("m.rbm"), "mlp:784-32-10", spec, params, about).ok());
  absl::StatusOr<LoadedModel> loaded = LoadModel(Path("m.rbm"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->file.model(), "mlp:784-32-10");
  EXPECT_EQ(loaded->file.steps(), 123);
  EXPECT_EQ(loaded->file.mode(), "ssp:2");
  EXPECT_EQ(loaded->file.test_accuracy(), 0.8125);
  ASSERT_EQ(loaded->params.size(), params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    ASSERT_EQ(loaded->params[t].size(), params[t].size());
    for (size_t i = 0; i < params[t].size(); ++i) {
      ASSERT_EQ(std::signbit(loaded->params[t][i]), std::signbit(params[t][i]));
      ASSERT_EQ(loaded->params[t][i], params[t][i]) << "tensor " << t << " element " << i;
    }
  }
  EXPECT_EQ(loaded->file.tensors(0).name(), "fc0.weight");
}

TEST(ModelFileTest, BadFilesAreNamedErrors) {
  const ModelSpec spec = *ParseModelSpec("mlp:784-16-10");
  const std::vector<std::vector<float>> params = InitModelParams(spec, 1);
  ASSERT_TRUE(ExportModel(Path("good.rbm"), "mlp:784-16-10", spec, params, {}).ok());
  // A tensor of the wrong count, on export.
  std::vector<std::vector<float>> short_params = params;
  short_params[1].pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(
      ExportModel(Path("short.rbm"), "mlp:784-16-10", spec, short_params, {})));
  // Damage: a flipped byte, then a file of another kind.
  ASSERT_EQ(std::system(("cp " + Path("good.rbm") + " " + Path("flipped.rbm")).c_str()), 0);
  {
    std::fstream f(Path("flipped.rbm"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    f.put('\x55');
  }
  EXPECT_THAT(LoadModel(Path("flipped.rbm")).status().message(), HasSubstr("checksum mismatch"));
  ASSERT_TRUE(WriteFramedFile(Path("other.rbm"), "RBCKPT1\n", "x").ok());
  EXPECT_THAT(LoadModel(Path("other.rbm")).status().message(), HasSubstr("bad magic"));
  EXPECT_TRUE(absl::IsNotFound(LoadModel(Path("missing.rbm")).status()));
  // Well-formed files whose contents do not fit their spec.
  auto rewrite = [&](const std::string& name, auto change) {
    ModelFile file;
    file.set_model("mlp:784-16-10");
    for (size_t t = 0; t < params.size(); ++t) {
      ModelTensor* tensor = file.add_tensors();
      tensor->set_name(t == 0   ? "fc0.weight"
                       : t == 1 ? "fc0.bias"
                       : t == 2 ? "fc1.weight"
                                : "fc1.bias");
      const std::vector<int64_t> shape = ModelParamSpecs(spec)[t].shape;
      for (int64_t d : shape) tensor->add_shape(d);
      tensor->set_values(std::string(reinterpret_cast<const char*>(params[t].data()),
                                     params[t].size() * sizeof(float)));
    }
    change(&file);
    ASSERT_TRUE(WriteFramedFile(Path(name), "RBMODEL1", file.SerializeAsString()).ok());
  };
  rewrite("unchanged.rbm", [](ModelFile*) {});
  EXPECT_TRUE(LoadModel(Path("unchanged.rbm")).ok());
  rewrite("spec.rbm", [](ModelFile* f) { f->set_model("mlp:784-17-10"); });
  EXPECT_THAT(LoadModel(Path("spec.rbm")).status().message(), HasSubstr("fc0.weight"));
  rewrite("name.rbm", [](ModelFile* f) { f->mutable_tensors(1)->set_name("fc0.b"); });
  EXPECT_THAT(LoadModel(Path("name.rbm")).status().message(), HasSubstr("'fc0.b'"));
  rewrite("fewer.rbm", [](ModelFile* f) { f->mutable_tensors()->RemoveLast(); });
  EXPECT_THAT(LoadModel(Path("fewer.rbm")).status().message(), HasSubstr("3 tensors"));
  rewrite("nan.rbm", [](ModelFile* f) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f->mutable_tensors(3)->mutable_values()->replace(0, 4, reinterpret_cast<const char*>(&nan), 4);
  });
  EXPECT_THAT(LoadModel(Path("nan.rbm")).status().message(), HasSubstr("non-finite"));
  rewrite("unknown.rbm", [](ModelFile* f) { f->set_model("resnet50"); });
  EXPECT_TRUE(absl::IsInvalidArgument(LoadModel(Path("unknown.rbm")).status()));
}

}  // namespace
}  // namespace rubato
