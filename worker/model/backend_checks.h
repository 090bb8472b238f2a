// Checks every ModelBackend must pass, shared by the CPU and CUDA backends' tests.
#ifndef RUBATO_WORKER_MODEL_BACKEND_CHECKS_H_
#define RUBATO_WORKER_MODEL_BACKEND_CHECKS_H_

#include "worker/model/model_backend.h"
#include "worker/model/model_spec.h"

namespace rubato {

// WeightsNeeded (model_backend.h): ForwardBackward announces each layer's tensors, first layer
// first, before it reads them. The host weights start as NaN and each layer's arrive only when it
// is announced, as a pull does in the training loop; the step must then equal one with every
// weight in place from the start (to rounding). A status returned there ends the pass with that
// status and no gradient handed over, and the backend computes the next step as before. With
// `lock_host_buffers`, the buffers are given to UseHostBuffers first (a GPU copies from them
// directly). Reports failures through GoogleTest.
void CheckWeightsArriveLayerByLayer(ModelBackend* backend, const ModelSpec& spec,
                                    bool lock_host_buffers);

}  // namespace rubato

#endif  // RUBATO_WORKER_MODEL_BACKEND_CHECKS_H_
