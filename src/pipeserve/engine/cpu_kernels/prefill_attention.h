// Blocked attention for prompt chunks (prefill_attention.cpp): many query rows against
// one key / value head at a time, flash-style (online softmax over blocks of 32 keys),
// causal, unmasked or with a boolean mask, grouped-query heads sharing their keys.
#pragma once

#include <cstdint>

namespace pipeserve {

// q (B, Hq, L, D), k and v (B, Hk, S, D), each with its own strides in elements (the last
// one 1); out at out + b * out_b + h * out_h + l * out_l (D contiguous floats).
struct PrefillAttention {
  const float *q, *k, *v;
  float* out;
  int64_t q_b, q_h, q_l;
  int64_t k_b, k_h, k_s;
  int64_t v_b, v_h, v_s;
  int64_t out_b, out_h, out_l;
  int B, Hq, Hk, L, S, D;
  float scale;
  bool causal;  // query row l sees keys up to position S - L + l
  // A boolean mask (false hides a key; null: none): (b, h, l, s) at
  // mask + b * m_b + h * m_h + l * m_l + s * m_s. Key blocks start at the first key a
  // task's rows see, so left padding leaves a row's numbers as they are without it.
  const bool* mask = nullptr;
  int64_t m_b = 0, m_h = 0, m_l = 0, m_s = 0;
};

// Fewer query positions than this take attend_query's path (decode steps, speculative
// verification: their numbers must not depend on the other rows' count).
constexpr int PREFILL_ATTENTION_MIN_L = 32;

// False (nothing written) where it does not apply: switched off, head size not a
// multiple of 16 up to 128, or too few query positions.
bool prefill_attention(const PrefillAttention& a);
void set_prefill_attention(bool on);
bool prefill_attention_enabled();

}  // namespace pipeserve
