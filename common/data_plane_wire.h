// The constants of the parameter servers' plain-TCP data plane, shared by the shard's side
// (server/data_plane.h, which documents the format) and the worker's (worker/ps/ps_data_channel.h).
#ifndef RUBATO_COMMON_DATA_PLANE_WIRE_H_
#define RUBATO_COMMON_DATA_PLANE_WIRE_H_

#include <cstdint>
#include <cstring>

namespace rubato {

// The server's first bytes on a connection: this magic and a fresh challenge (common/auth.h).
inline constexpr char kDataChallengeMagic[8] = {'R', 'B', 'P', 'S', 'C', 'H', 'L', '1'};
inline constexpr int kDataChallengeBytes = 32;
// The client's hello: this magic, its worker id and its answer to the challenge.
inline constexpr char kDataHelloMagic[8] = {'R', 'B', 'P', 'S', 'D', 'A', 'T', '2'};
inline constexpr int kDataMaxAnswerBytes = 1024;
inline constexpr int kDataMaxTextBytes = 1024;
inline constexpr int kDataRequestHeaderBytes = 24;
inline constexpr int kDataResponseHeaderBytes = 16;
enum class DataMethod : int32_t { kPush = 1, kPull = 2 };
inline constexpr int kMaxConnectionsPerWorker = 16;

// A header field at `at`, in the host's (little-endian) layout, without alignment.
template <typename T>
T WireLoad(const char* at) {
  T v;
  std::memcpy(&v, at, sizeof(T));
  return v;
}
template <typename T>
void WireStore(char* at, T v) {
  std::memcpy(at, &v, sizeof(T));
}

}  // namespace rubato

#endif  // RUBATO_COMMON_DATA_PLANE_WIRE_H_
