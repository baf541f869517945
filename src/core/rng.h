#pragma once
// Counter-based generator (SplitMix64 over a stream position): any element of a stream can be
// drawn independently, so initialisation is identical for every thread count.
#include <cmath>
#include <cstdint>

namespace moe {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Stable across platforms and library versions (unlike std::hash), so a (seed, name) stream
// always draws the same numbers.
inline uint64_t fnv1a(const char* s, uint64_t h = 0xcbf29ce484222325ull) {
  for (; *s; ++s) h = (h ^ static_cast<unsigned char>(*s)) * 0x100000001b3ull;
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : state_(splitmix64(seed ^ 0x6A09E667F3BCC909ull)) {}
  uint64_t next_u64() { return splitmix64(state_++); }
  // Uniform in [0, 1) with 24 bits.
  float uniform() { return static_cast<float>(next_u64() >> 40) * (1.0f / 16777216.0f); }
  double uniform_double() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  float normal() {
    const double u1 = 1.0 - uniform_double();
    const double u2 = uniform_double();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; }

 private:
  uint64_t state_;
};

}  // namespace moe
