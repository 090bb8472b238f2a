// Exported models (proto/model_file.proto in a framed file, common/framed_file.h): what
// rubato_worker --export_model writes at the end of a job and --eval_model reads.
#ifndef RUBATO_WORKER_MODEL_MODEL_FILE_H_
#define RUBATO_WORKER_MODEL_MODEL_FILE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/model_file.pb.h"
#include "worker/model/model_spec.h"

namespace rubato {

// Writes `params` (ModelParamSpecs(spec) order and sizes) under `model` (the spec's text) with
// `about` (steps, mode, accuracy... ; its model and tensors are ignored), atomically.
absl::Status ExportModel(const std::string& path, const std::string& model, const ModelSpec& spec,
                         absl::Span<const std::vector<float>> params, const ModelFile& about);

struct LoadedModel {
  ModelFile file;  // Its tensors' values cleared once copied into params.
  ModelSpec spec;
  std::vector<std::vector<float>> params;  // ModelParamSpecs(spec) order.
};

// Reads and checks an exported model: DATA_LOSS for a damaged file, INVALID_ARGUMENT naming the
// tensor for a model spec that does not parse, a missing, extra, misnamed or misshapen tensor, or
// a non-finite value.
absl::StatusOr<LoadedModel> LoadModel(const std::string& path);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_MODEL_FILE_H_
