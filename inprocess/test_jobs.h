// What the in-process job tests (training_loop_test, kill_points_test) share: a learnable
// synthetic dataset, and the client options of one of a job's workers.
#ifndef RUBATO_INPROCESS_TEST_JOBS_H_
#define RUBATO_INPROCESS_TEST_JOBS_H_

#include <cstdint>

#include "proto/cluster.pb.h"
#include "worker/data/dataset.h"
#include "worker/model/model_spec.h"
#include "worker/ps/ps_client.h"

namespace rubato {

// `n` examples of 8 features in [0, 1) whose label (of 3) is the argmax of a fixed linear map of
// the features: learnable. The same `seed`, the same examples.
Dataset SyntheticDataset(int n, uint64_t seed);

// Worker `worker`'s client options for a job of `cluster` training `spec` for `steps` steps
// (16 steps an epoch): its id, the job's workers and consistency, and the model's tensors.
PsClientOptions InProcessClientOptions(const ModelSpec& spec, const ClusterSpec& cluster,
                                       int worker, int64_t steps);

}  // namespace rubato

#endif  // RUBATO_INPROCESS_TEST_JOBS_H_
