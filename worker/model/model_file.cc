#include "worker/model/model_file.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/framed_file.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"

namespace rubato {
namespace {

constexpr absl::string_view kMagic("RBMODEL1", 8);

}  // namespace

absl::Status ExportModel(const std::string& path, const std::string& model, const ModelSpec& spec,
                         absl::Span<const std::vector<float>> params, const ModelFile& about) {
  const std::vector<ParamSpec> specs = ModelParamSpecs(spec);
  if (specs.size() != params.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("export: ", params.size(), " tensors for a ", specs.size(), "-tensor model"));
  }
  ModelFile file = about;
  file.set_model(model);
  file.clear_tensors();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (static_cast<int64_t>(params[i].size()) != specs[i].elements()) {
      return absl::InvalidArgumentError(absl::StrCat("export: tensor '", specs[i].name, "' has ",
                                                     params[i].size(), " values, not ",
                                                     specs[i].elements()));
    }
    ModelTensor* t = file.add_tensors();
    t->set_name(specs[i].name);
    for (int64_t d : specs[i].shape) t->add_shape(d);
    FloatsToBytes(params[i], t->mutable_values());
  }
  file.set_written_unix_ms(absl::ToUnixMillis(absl::Now()));
  std::string payload;
  if (!file.SerializeToString(&payload)) return absl::InternalError("export: model too large");
  if (absl::Status s = WriteFramedFile(path, kMagic, payload); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--export_model: ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string payload, ReadFramedFile(path, kMagic));
  LoadedModel loaded;
  if (!loaded.file.ParseFromString(payload)) {
    return absl::DataLossError(absl::StrCat(path, ": the payload does not parse"));
  }
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(loaded.file.model());
  if (!spec.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": model '", loaded.file.model(), "': ", spec.status().message()));
  }
  loaded.spec = std::move(*spec);
  const std::vector<ParamSpec> specs = ModelParamSpecs(loaded.spec);
  if (loaded.file.tensors_size() != static_cast<int>(specs.size())) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", loaded.file.tensors_size(),
                                                   " tensors, but model '", loaded.file.model(),
                                                   "' has ", specs.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    ModelTensor* t = loaded.file.mutable_tensors(static_cast<int>(i));
    const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
    if (t->name() != specs[i].name || shape != specs[i].shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor ", i, " is '", t->name(), "' ", ShapeString(shape), ", but model '",
          loaded.file.model(), "' has '", specs[i].name, "' ", ShapeString(specs[i].shape)));
    }
    RETURN_IF_ERROR(CheckFloatBytes(absl::StrCat(path, ": tensor '", t->name(), "'"), t->values(),
                                    specs[i].elements()));
    loaded.params.emplace_back(specs[i].elements());
    BytesToFloats(t->values(), absl::MakeSpan(loaded.params.back()));
    t->clear_values();
  }
  return loaded;
}

}  // namespace rubato
