// Small deterministic helpers for seeding random streams reproducibly on every platform.
#ifndef RUBATO_COMMON_RANDOM_H_
#define RUBATO_COMMON_RANDOM_H_

#include <cstdint>

namespace rubato {

// SplitMix64's finaliser (Steele, Lea and Flood 2014): a bijective mix, so that nearby inputs such
// as (seed, rank, epoch) or (seed, tensor index) give unrelated seeds.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace rubato

#endif  // RUBATO_COMMON_RANDOM_H_
