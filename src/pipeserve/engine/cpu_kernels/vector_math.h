// Elementwise math the compiler vectorises (no branches, no calls) for whatever
// instruction set the build targets.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace pipeserve {

// exp(x) as 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by Cephes' expf
// polynomial: within ~1 ulp of std::exp. Exactly 0 below -87 (e^-87 is at the edge of
// float32's normal range; softmax weights of masked, -inf, scores) and inf above 88.
inline float fast_exp(float x) {
  const float clamped = std::clamp(x, -87.0f, 88.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = n * -0.693359375f + clamped;  // x - n ln 2, ln 2 in two parts
  r = n * 2.12194440e-4f + r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  const float value = x > 88.0f ? INFINITY : e_r * two_n;
  return x < -87.0f ? 0.0f : value;
}

}  // namespace pipeserve
