// Gloo peer for experiments/allreduce_peers.sh: gloo::AllreduceRing (sum) over TCP on loopback,
// float32 buffers of 1, 16 and 64 MB; rendezvous through a FileStore in a directory. Prints
// "gloo <ranks> <MB> <seconds per all-reduce>" from rank 0 (its own time) and checks the result.
//
//   gloo_allreduce RANK SIZE STORE_DIR
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "gloo/allreduce_ring.h"
#include "gloo/barrier_all_to_all.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: gloo_allreduce RANK SIZE STORE_DIR\n");
    return 2;
  }
  const int rank = std::atoi(argv[1]), size = std::atoi(argv[2]);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(argv[3]);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->connectFullMesh(store, device);
  const int mbs[] = {1, 16, 64};
  const int iters[] = {50, 20, 10};
  for (int k = 0; k < 3; ++k) {
    const size_t n = size_t{static_cast<size_t>(mbs[k])} * 1024 * 1024 / 4;
    std::vector<float> data(n);
    std::vector<float*> ptrs = {data.data()};
    gloo::AllreduceRing<float> allreduce(context, ptrs, static_cast<int>(n));
    // Warm-up (3 runs); the first is checked. The timed runs sum in place, like Rubato's.
    std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
    allreduce.run();
    const float expected = static_cast<float>(size) * (size + 1) / 2;
    const bool ok = data[0] == expected && data[n - 1] == expected;
    std::fill(data.begin(), data.end(), 1.0f / size);
    allreduce.run();
    allreduce.run();
    const auto start = std::chrono::steady_clock::now();
    for (int it = 0; it < iters[k]; ++it) allreduce.run();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters[k];
    if (rank == 0) std::printf("gloo %d %d %.6f %s\n", size, mbs[k], t, ok ? "ok" : "WRONG");
  }
  // No rank leaves (closing its connections) while another may still be reading from it.
  gloo::BarrierAllToAll(context).run();
  return 0;
}
