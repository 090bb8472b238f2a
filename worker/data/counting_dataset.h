// For the data tests: a Dataset whose example i has every feature equal to i and label i % 10, so
// that a drawn batch row names its example.
#ifndef RUBATO_WORKER_DATA_COUNTING_DATASET_H_
#define RUBATO_WORKER_DATA_COUNTING_DATASET_H_

#include <cstdint>

#include "worker/data/dataset.h"

namespace rubato {

inline Dataset CountingDataset(int64_t size, int64_t dim) {
  Dataset data;
  data.size = size;
  data.dim = dim;
  data.num_classes = 10;
  for (int64_t i = 0; i < size; ++i) {
    data.features.insert(data.features.end(), dim, static_cast<float>(i));
    data.labels.push_back(static_cast<int32_t>(i % 10));
  }
  return data;
}

}  // namespace rubato

#endif  // RUBATO_WORKER_DATA_COUNTING_DATASET_H_
