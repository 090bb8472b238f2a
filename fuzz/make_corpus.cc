// make_corpus: writes the seed corpora of the fuzz harnesses, one serialized case per file, into
// <dir>/shard_fuzzer/seed-<name> and <dir>/ring_mailbox_fuzzer/seed-<name>, and one client
// connection's bytes per file into <dir>/data_plane_fuzzer/seed-<name>:
//
//   bazel run //fuzz:make_corpus -- $PWD/fuzz/corpus
//
// (or in the fuzz output base: bazel --output_base=$HOME/.cache/bazel-rubato-fuzz run
// --config=fuzz //fuzz:make_corpus -- $PWD/fuzz/corpus)
//
// The seeds are written below in protobuf text format (fuzz/fuzz_case.proto): each is a small,
// mostly valid session, so that the fuzzer starts from inputs that reach deep into the code.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "fuzz/fuzz_case.pb.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"
#include "proto/parameter_server.pb.h"

namespace rubato {
namespace fuzz {
namespace {

// name -> ShardFuzzCase in text format.
const std::vector<std::pair<std::string, std::string>> kShardSeeds = {
    // bsp in parts of 2 elements: the 3x2 kernel has three parts. Worker 1 sends its last part
    // first (held), through the service; worker 0 its parts in turn and the rest whole; then
    // worker 1 the rest, a part twice (a duplicate) and a part at a wrong offset (refused).
    {"bsp-parts", R"pb(
       cluster {
         num_workers: 2
         consistency { mode: BSP }
         optimizer { type: "sgd" learning_rate: 0.1 }
       }
       start_ready: true
       part_elements: 2
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0 ]
           parts: [ 2 ]
           values: [ 1, -2 ]
           as_service: true
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           parts: [ 0, -1, -1 ]
           values: [ 0.5 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0 ]
           parts: [ 1 ]
           values: [ 0.25 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0 ]
           parts: [ 2 ]
           values: [ 3 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           parts: [ 0, -1, -1 ]
           values: [ 2 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0 ]
           parts: [ 0 ]
         }
       }
       actions {
         push {
           worker_id: 1
           step: 0
           gradients { name: "dense.weight" data: "\000\000\200?" offset: 1 }
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0 ]
           parts: [ 1 ]
           values: [ -1 ]
         }
       }
       actions {
         pull {
           request { worker_id: 0 step: 1 }
           tensors: [ 0, 1, 2 ]
         }
       }
       actions { stats: true }
     )pb"},
    // An adaptive batch: two workers of 8, a decision every 2 steps from worker 0's relay (B_simple
    // 32 -> 16 a worker from step 4), then pushes of the old batch (refused) and the new one.
    {"bsp-adaptive-batch", R"pb(
       cluster {
         num_workers: 2
         consistency { mode: BSP }
         optimizer { type: "sgd" learning_rate: 0.1 }
         lr_schedule { scaling: "sqrt" }
         adaptive_batch { min_global_batch: 16 max_global_batch: 64 every_steps: 2 }
       }
       start_ready: true
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 1
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 1
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 2
           tensors: [ 0, 1, 2 ]
           batch_size: 8
           noise_relay { step: 0 g2_ema: 1 trace_ema: 64 }
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 2
           tensors: [ 0, 1, 2 ]
           batch_size: 8
           as_service: true
           noise_relay { step: 0 g2_ema: 1 trace_ema: 32 }
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 3
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 3
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 4
           tensors: [ 0, 1, 2 ]
           batch_size: 8
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 4
           tensors: [ 0, 1, 2 ]
           batch_size: 16
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 4
           tensors: [ 0, 1, 2 ]
           batch_size: 16
           noise_relay { step: 2 g2_ema: nan trace_ema: 1 }
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 4
           tensors: [ 0, 1, 2 ]
           batch_size: 16
         }
       }
       actions {
         register_worker {
           request { worker_id: 1 batch_size: 9 }
           use_shard_job: true
           use_ready_model: true
         }
       }
       actions { stats: true }
     )pb"},
    // Two bsp workers on the harness's model: step 0 and 1 pulled, pushed and applied.
    {"bsp-two-steps", R"pb(
       cluster {
         num_workers: 2
         consistency { mode: BSP }
         optimizer { type: "sgd" learning_rate: 0.1 }
       }
       start_ready: true
       actions { pull { request { worker_id: 0 step: 0 } } }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 0.5, -1 ]
         }
       }
       actions { pull { request { worker_id: 0 step: 1 } } }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 0.25 ]
         }
       }
       actions {
         pull {
           request { worker_id: 1 step: 1 }
           tensors: [ 1 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 1
           tensors: [ 2 ]
           values: [ 1 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0 ]
           values: [ 1 ]
         }
       }
       actions { heartbeat { worker_id: 1 step: 2 } }
       actions { stats: true }
       actions { finish { worker_id: 0 step: 2 } }
       actions { finish { worker_id: 7 step: -1 } }
       actions { finish { worker_id: 1 step: 2 } }
     )pb"},
    // Three bsp workers pushing through the service's entry point out of worker order: worker 2's
    // gradients are held for workers 0 and 1, answered once added; worker 1's second push is held
    // until it expires (wait_timeout_ms), and the rest answer at shutdown.
    {"bsp-service-held", R"pb(
       cluster {
         num_workers: 3
         consistency { mode: BSP }
         optimizer { type: "sgd" learning_rate: 0.1 }
       }
       start_ready: true
       actions {
         gradient_push {
           worker_id: 2
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 1 ]
           as_service: true
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1 ]
           values: [ 2 ]
           as_service: true
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 3 ]
           as_service: true
         }
       }
       actions { sleep_us: 2000 }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 2 ]
           values: [ 2 ]
           as_service: true
         }
       }
       actions {
         gradient_push {
           worker_id: 2
           step: 1
           tensors: [ 0 ]
           values: [ 1 ]
           as_service: true
         }
       }
       actions { sleep_us: 2000 }
       actions { pull { request { worker_id: 0 step: 1 } } }
     )pb"},
    // A worker registers its own model with initial values, then sends malformed requests.
    {"register-and-refusals", R"pb(
       cluster {
         num_workers: 1
         consistency { mode: BSP }
       }
       actions {
         register_worker {
           request {
             worker_id: 0
             batch_size: 4
             steps_per_epoch: 5
             total_steps: 50
             model {
               name: "fc.w"
               shape: [ 2, 2 ]
             }
             model {
               name: "fc.b"
               shape: [ 2 ]
             }
           }
           use_shard_job: true
           fill_initial_values: true
         }
       }
       actions {
         push {
           worker_id: 0
           step: 0
           gradients { name: "fc.b" data: "\000\000\200?\000\000\200?" }
         }
       }
       actions {
         push {
           worker_id: 0
           step: 1
           gradients { name: "fc.b" data: "\000\000\300\177\000\000\200?" }
         }
       }
       actions {
         push {
           worker_id: 0
           step: 1
           gradients { name: "fc.b" data: "abc" }
         }
       }
       actions {
         push {
           worker_id: 0
           step: 1
           gradients { name: "nope" data: "abcd" }
         }
       }
       actions { push { worker_id: 3 step: 0 } }
       actions { push { worker_id: 0 step: -1 } }
       actions {
         pull {
           request {
             worker_id: 0
             step: 1
             names: [ "fc.w", "missing" ]
           }
         }
       }
       actions {
         pull {
           request {
             worker_id: 0
             step: 1
             names: [ "fc.w", "fc.w" ]
           }
         }
       }
       actions {
         register_worker {
           request {
             worker_id: 0
             num_workers: 1
             consistency { mode: BSP }
             batch_size: 4
             model {
               name: "fc.w"
               shape: [ 3 ]
             }
           }
         }
       }
     )pb"},
    // Three async workers under Adam, pushing at staleness > 0, with staleness-aware rates.
    {"async-adam", R"pb(
       cluster {
         num_workers: 3
         consistency { mode: ASYNC staleness_aware_lr: true }
         optimizer { type: "adam" learning_rate: 0.01 weight_decay: 0.1 }
       }
       start_ready: true
       actions { pull { request { worker_id: 0 step: 0 } } }
       actions { pull { request { worker_id: 1 step: 0 } } }
       actions { pull { request { worker_id: 2 step: 0 } } }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 1, 2, 3 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ -1 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 2
           step: 0
           tensors: [ 0 ]
           values: [ 0.5 ]
         }
       }
       actions {
         pull {
           request { worker_id: 0 step: 1 }
           tensors: [ 0, 1 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 1
           tensors: [ 0, 1 ]
           values: [ 1e30, -1e30 ]
         }
       }
       actions {
         pull {
           request { worker_id: 2 step: 7 }
           tensors: [ 0, 2 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 2
           step: 5
           tensors: [ 0, 2 ]
           values: [ 3 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 3
           tensors: [ 0 ]
           values: [ 3 ]
         }
       }
     )pb"},
    // SSP with staleness 1: a pull two steps ahead of a slow worker waits, then is released.
    {"ssp-bound", R"pb(
       cluster {
         num_workers: 2
         consistency { mode: SSP staleness: 1 }
         optimizer { type: "sgd" learning_rate: 0.5 momentum: 0.9 nesterov: true }
       }
       start_ready: true
       actions { pull { request { worker_id: 0 step: 0 } } }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 1 ]
         }
       }
       actions { pull { request { worker_id: 0 step: 1 } } }
       actions {
         gradient_push {
           worker_id: 0
           step: 1
           tensors: [ 0, 1, 2 ]
           values: [ 1 ]
         }
       }
       actions { pull { request { worker_id: 0 step: 3 } } }
       actions { pull { request { worker_id: 1 step: 0 } } }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 2 ]
         }
       }
       actions { pull { request { worker_id: 1 step: 1 } } }
       actions {
         gradient_push {
           worker_id: 1
           step: 1
           tensors: [ 0, 1, 2 ]
           values: [ 2 ]
         }
       }
       actions { pull { request { worker_id: 1 step: 2 } } }
       actions { sleep_us: 1500 }
       actions { stats: true }
     )pb"},
    // backup:1 of 3 under LAMB with warmup and cosine decay: a late gradient is dropped.
    {"backup-lamb", R"pb(
       cluster {
         num_workers: 3
         consistency { mode: BACKUP backup_workers: 1 }
         optimizer { type: "lamb" learning_rate: 0.01 weight_decay: 0.01 }
         lr_schedule { warmup_steps: 2 decay: "cosine" scaling: "sqrt" reference_batch: 8 }
       }
       start_ready: true
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 0.1 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 0.2 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 2
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 0.3 ]
         }
       }
       actions { pull { request { worker_id: 2 step: 1 } } }
       actions {
         gradient_push {
           worker_id: 2
           step: 1
           tensors: [ 0, 1, 2, 0 ]
           values: [ 0.3 ]
         }
       }
       actions {
         gradient_push {
           worker_id: 2
           step: 1
           tensors: [ 1 ]
           values: [ 0.3 ]
         }
       }
     )pb"},
    // A 2 ms lease: a silent worker is dropped, is told so, and registers again.
    {"lease-rejoin", R"pb(
       cluster {
         num_workers: 2
         consistency { mode: BSP }
         optimizer { type: "lars" learning_rate: 1 }
       }
       short_lease_ms: 2
       start_ready: true
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 1 ]
         }
       }
       actions { sleep_us: 2000 }
       actions { heartbeat { worker_id: 0 step: 1 } }
       actions { sleep_us: 2000 }
       actions {
         gradient_push {
           worker_id: 1
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 1 ]
         }
       }
       actions {
         register_worker {
           request {
             worker_id: 1
             batch_size: 8
             steps_per_epoch: 10
             total_steps: 1000
             resume_step: 1
           }
           use_shard_job: true
           use_ready_model: true
         }
       }
       actions { pull { request { worker_id: 1 step: 1 } } }
       actions { heartbeat { worker_id: 1 step: 1 } }
     )pb"},
    // Two shards, shard 1, two update threads, AdamW with exclusions, a job mismatch.
    {"shard1-adamw", R"pb(
       cluster {
         num_workers: 1
         consistency { mode: BSP }
         optimizer {
           type: "adamw"
           learning_rate: 0.001
           weight_decay: 0.05
           exclude_from_weight_decay: "bias"
         }
       }
       shard_id: 1
       num_shards: 2
       update_threads: 2
       actions {
         register_worker {
           request { worker_id: 0 num_workers: 2 batch_size: 8 }
           use_ready_model: true
         }
       }
       actions {
         register_worker {
           request { worker_id: 0 batch_size: 8 }
           use_shard_job: true
           use_ready_model: true
         }
       }
       actions {
         gradient_push {
           worker_id: 0
           step: 0
           tensors: [ 0, 1, 2 ]
           values: [ 0.5 ]
         }
       }
       actions { pull { request { worker_id: 0 step: 1 } } }
     )pb"},
};

// name -> RingFuzzCase in text format.
const std::vector<std::pair<std::string, std::string>> kRingSeeds = {
    // Two blocks from rank 3, cut inside floats, taken out of order: copied, then added.
    {"two-blocks-cut", R"pb(
       from_rank: 3
       messages {
         floats {
           from_rank: 3
           tag: 0
           values: [ 1, 2, 3, 4, 5 ]
         }
         cuts: [ 3, 9, 10, 17 ]
       }
       messages {
         floats {
           use_mailbox_rank: true
           tag: 1
           values: [ 0.5, -0.5, 1e-3 ]
         }
         cuts: [ 1, 5, 6, 7 ]
       }
       actions { deliver: 0 }
       actions { deliver: 1 }
       actions { take { tag: 1 use_block_size: true } }
       actions {
         take {
           tag: 0
           floats: 5
           add: true
           initial: [ 10, 20 ]
         }
       }
     )pb"},
    // Malformed: a NaN, a wrong sender, a negative tag, partial floats, a repeated tag, sizes.
    {"refusals", R"pb(
       from_rank: 1
       messages {
         floats {
           from_rank: 1
           tag: 5
           values: [ 1, nan, 2 ]
         }
         cuts: [ 6 ]
       }
       messages {
         floats {
           from_rank: 2
           tag: 6
           values: [ 1 ]
         }
       }
       messages { block { from_rank: 1 tag: -4 data: "\000\000\200?" } }
       messages {
         block { from_rank: 1 tag: 7 data: "\000\000\200?\001" }
         cuts: [ 4, 8 ]
       }
       messages { block { from_rank: 1 tag: 8 data: "\000\000\200?\000\000\000@" } }
       actions { deliver: 0 }
       actions { take { tag: 5 use_block_size: true } }
       actions { deliver: 1 }
       actions { deliver: 2 }
       actions { deliver: 3 }
       actions { deliver: 4 }
       actions { deliver: 4 }
       actions { take { tag: 8 floats: 3 } }
     )pb"},
    // The stream breaks, reopens, and the link aborts: takes of missing blocks fail each way.
    {"broken-aborted", R"pb(
       from_rank: 0
       messages {
         floats {
           tag: 2
           values: [ 7, 8 ]
         }
       }
       actions { take { tag: 1 floats: 2 } }
       actions { stream_broke: "the stream ended without its closing block" }
       actions { take { tag: 1 floats: 2 } }
       actions { deliver: 0 }
       actions {
         take {
           tag: 2
           floats: 2
           add: true
           initial: [ 1 ]
         }
       }
       actions { stream_opened: true }
       actions { abort: "next rank 1 is gone" }
       actions { take { tag: 3 floats: 1 } }
     )pb"},
    // Raw bytes: an empty block, a sync block, fields after data, a truncated varint, an unknown
    // field, and a header longer than the parser's 40-byte window.
    {"raw-headers", R"pb(
       from_rank: 2
       messages { raw: "" }
       messages { raw: "\010\002\020\376\377\377\377\377\377\377\377\377\001" }
       messages { raw: "\010\002\020\003\032\004\000\000\200?\010\002" }
       messages { raw: "\010\002\020\377" }
       messages { raw: "\010\002 \001\032\000" }
       messages {
         raw: "\010\002\010\002\010\002\010\002\010\002\010\002\010\002\010\002\010\002\010\002"
              "\010\002\010\002\010\002\010\002\010\002\010\002\010\002\010\002\010\002\010\002"
              "\020\005\032\004\000\000\200?"
       }
       actions { deliver: 0 }
       actions { deliver: 1 }
       actions { deliver: 2 }
       actions { deliver: 3 }
       actions { deliver: 4 }
       actions { deliver: 5 }
       actions { take { tag: 5 floats: 1 } }
     )pb"},
    // A larger block (80 floats) in many slices, added into a destination.
    {"many-slices", R"pb(
       from_rank: 5
       messages {
         floats {
           from_rank: 5
           tag: 9
           values: [
             1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
             21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40,
             41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60,
             61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80
           ]
         }
         cuts: [ 2, 4, 5, 13, 21, 22, 23, 64, 65, 66, 67, 68, 69, 70, 71, 200, 201, 202, 203, 300 ]
       }
       actions { deliver: 0 }
       actions {
         take {
           tag: 9
           use_block_size: true
           add: true
           initial: [ 0.5, -0.25, 3 ]
         }
       }
     )pb"},
};

// The data plane's seeds are raw byte streams (one client connection each, server/data_plane.h):
// a hello, then requests, for the fuzzer's shard of two workers with tensors "w" (4) and "b" (2).
std::string DataHello(int32_t worker, const std::string& token, int32_t token_bytes = -1) {
  std::string h = "RBPSDAT1";
  const int32_t n = token_bytes >= 0 ? token_bytes : static_cast<int32_t>(token.size());
  h.append(reinterpret_cast<const char*>(&worker), 4);
  h.append(reinterpret_cast<const char*>(&n), 4);
  return h + token;
}
std::string DataRequest(int32_t method, int64_t timeout_ms, const std::string& body,
                        int64_t claimed_bytes = -1) {
  const int32_t reserved = 0;
  const int64_t bytes = claimed_bytes >= 0 ? claimed_bytes : static_cast<int64_t>(body.size());
  std::string r(reinterpret_cast<const char*>(&method), 4);
  r.append(reinterpret_cast<const char*>(&reserved), 4);
  r.append(reinterpret_cast<const char*>(&timeout_ms), 8);
  r.append(reinterpret_cast<const char*>(&bytes), 8);
  return r + body;
}
std::string DataPull(int32_t worker, int64_t step) {
  rubato::PullRequest pull;
  pull.set_worker_id(worker);
  pull.set_step(step);
  pull.add_names("w");
  pull.add_names("b");
  return DataRequest(2, 1000, pull.SerializeAsString());
}
std::string DataPush(int32_t worker, int64_t step, float value) {
  rubato::PushRequest push;
  push.set_worker_id(worker);
  push.set_step(step);
  for (const auto& [name, elements] : {std::pair<const char*, int>{"w", 4}, {"b", 2}}) {
    rubato::TensorValue* g = push.add_gradients();
    g->set_name(name);
    std::string data;
    for (int i = 0; i < elements; ++i) data.append(reinterpret_cast<const char*>(&value), 4);
    g->set_data(data);
  }
  return DataRequest(1, 1000, push.SerializeAsString());
}

const std::vector<std::pair<std::string, std::string>>& DataPlaneSeeds() {
  static const auto* seeds = new std::vector<std::pair<std::string, std::string>>{
      {"pull", DataHello(0, "") + DataPull(0, 0)},
      {"push-pull", DataHello(0, "") + DataPush(0, 0, 0.5f) + DataPull(0, 1)},
      {"two-pushes-as-worker-1",
       DataHello(1, "worker/1/token") + DataPush(1, 0, 0.25f) + DataPush(1, 1, -1.0f)},
      {"push-as-another-worker", DataHello(1, "") + DataPush(0, 0, 0.5f) + DataPull(1, 0)},
      {"garbage-body-then-pull",
       DataHello(0, "") + DataRequest(1, 0, "\xff\xff garbage") + DataPull(0, 0)},
      {"oversized-request", DataHello(0, "") + DataRequest(1, 1000, "", int64_t{1} << 30)},
      {"short-body", DataHello(0, "") + DataRequest(2, 1000, "\x08", 4096)},
      {"unknown-method", DataHello(0, "") + DataRequest(9, 1000, "")},
      {"token-length-out-of-range", DataHello(0, "", 1 << 20)},
      {"not-a-hello", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"},
  };
  return *seeds;
}

bool WriteRawSeeds(const std::string& dir,
                   const std::vector<std::pair<std::string, std::string>>& seeds) {
  mkdir(dir.c_str(), 0755);
  for (const auto& [name, bytes] : seeds) {
    const std::string path = dir + "/seed-" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out || !out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
      std::fprintf(stderr, "make_corpus: cannot write %s\n", path.c_str());
      return false;
    }
    std::printf("%s (%zu bytes)\n", path.c_str(), bytes.size());
  }
  return true;
}

bool WriteSeeds(const std::string& dir,
                const std::vector<std::pair<std::string, std::string>>& seeds,
                google::protobuf::Message* prototype) {
  mkdir(dir.c_str(), 0755);
  for (const auto& [name, text] : seeds) {
    prototype->Clear();
    if (!google::protobuf::TextFormat::ParseFromString(text, prototype)) {
      std::fprintf(stderr, "make_corpus: seed %s does not parse\n", name.c_str());
      return false;
    }
    const std::string path = dir + "/seed-" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out || !prototype->SerializeToOstream(&out)) {
      std::fprintf(stderr, "make_corpus: cannot write %s\n", path.c_str());
      return false;
    }
    std::printf("%s (%zu bytes)\n", path.c_str(), prototype->ByteSizeLong());
  }
  return true;
}

}  // namespace
}  // namespace fuzz
}  // namespace rubato

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus DIR (e.g. $PWD/fuzz/corpus)\n");
    return 2;
  }
  const std::string dir = argv[1];
  mkdir(dir.c_str(), 0755);
  rubato::fuzz::ShardFuzzCase shard;
  rubato::fuzz::RingFuzzCase ring;
  const bool ok =
      rubato::fuzz::WriteSeeds(dir + "/shard_fuzzer", rubato::fuzz::kShardSeeds, &shard) &&
      rubato::fuzz::WriteSeeds(dir + "/ring_mailbox_fuzzer", rubato::fuzz::kRingSeeds, &ring) &&
      rubato::fuzz::WriteRawSeeds(dir + "/data_plane_fuzzer", rubato::fuzz::DataPlaneSeeds());
  return ok ? 0 : 1;
}
