/* OpenMPI peer for experiments/allreduce_peers.sh: MPI_Allreduce (sum) of float32 buffers of
 * 1, 16 and 64 MB; prints "mpi <ranks> <MB> <seconds per all-reduce>" from rank 0, the slowest
 * rank's time, and checks the result. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int mbs[] = {1, 16, 64};
  const int iters[] = {50, 20, 10};
  for (int k = 0; k < 3; ++k) {
    const long n = (long)mbs[k] * 1024 * 1024 / 4;
    float* in = malloc(n * sizeof(float));
    float* out = malloc(n * sizeof(float));
    for (long i = 0; i < n; ++i) in[i] = (float)(rank + 1);
    for (int it = 0; it < 3; ++it) { /* warm-up */
      MPI_Allreduce(in, out, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int it = 0; it < iters[k]; ++it) {
      MPI_Allreduce(in, out, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    double t = (MPI_Wtime() - start) / iters[k], worst;
    MPI_Reduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    const float expected = (float)size * (size + 1) / 2;
    int ok = out[0] == expected && out[n - 1] == expected, all_ok;
    MPI_Reduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("mpi %d %d %.6f %s\n", size, mbs[k], worst, all_ok ? "ok" : "WRONG");
    free(in);
    free(out);
  }
  MPI_Finalize();
  return 0;
}
