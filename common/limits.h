// Limits on what a peer may send: every field of every RPC that carries a count, a size, an id or a
// clock is checked against one of these before it is used (proto/parameter_server.proto and
// proto/ring.proto name the limit of each field). They sit in one place so that the proto comments,
// the servers' checks, the clients' own checks and the tests agree.
//
// The bounds are chosen so that no arithmetic on a checked value can overflow: a step is below
// 2^48, so step + staleness, clock + 1 and version / members stay far inside int64; an element
// count is below 2^28, so elements * 4 fits in int32 and in int64 alike.
#ifndef RUBATO_COMMON_LIMITS_H_
#define RUBATO_COMMON_LIMITS_H_

#include <cstdint>

namespace rubato {

// Workers in a job (ClusterSpec.num_workers) and shards (servers).
inline constexpr int kMaxWorkers = 4096;
inline constexpr int kMaxShards = 1024;

// Tensors in a model (RegisterRequest.model), in one push, or named by one pull.
inline constexpr int kMaxTensors = 65536;
// A tensor's name, in bytes; its rank; its element count (2^28 floats = 1 GiB, the most that fits a
// message with room for framing).
inline constexpr int kMaxTensorNameBytes = 256;
inline constexpr int kMaxTensorRank = 8;
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 28;

// Steps, versions and resume points: 2^48 steps is 9000 years at one step per millisecond.
inline constexpr int64_t kMaxStep = int64_t{1} << 48;

// A worker's batch (RegisterRequest.batch_size), and steps_per_epoch / total_steps.
inline constexpr int32_t kMaxBatchSize = 1 << 24;

// SSP staleness bound and backup-worker count (ClusterSpec.consistency).
inline constexpr int32_t kMaxStaleness = 1 << 20;
// Adaptive consistency's steps between decisions.
inline constexpr int32_t kMaxAdaptiveEverySteps = 1 << 20;

// Largest gRPC message either end accepts unless the cluster spec says otherwise
// (ClusterSpec.max_message_bytes). Messages are buffered whole before they are parsed, so this
// bounds what one call can make a server hold; ./rubato launch derives it from the model.
inline constexpr int64_t kDefaultMaxMessageBytes = int64_t{64} << 20;
// The largest value max_message_bytes may take: protobuf cannot parse 2 GiB or more.
inline constexpr int64_t kMaxMessageBytesLimit = int64_t{1} << 30;

}  // namespace rubato

#endif  // RUBATO_COMMON_LIMITS_H_
