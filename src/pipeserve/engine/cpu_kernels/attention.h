// Attention of one query row against one key / value head on the CPU: the inner loop of
// the decoder-layer op (fused_layer.cpp: decode steps and speculative verifications) and
// of Sdpa (fused.cpp: short prefills).
//
// A query's result depends only on its own q, keys, values, mask and `seen`, never on the
// other rows or tokens of the step, nor on how queries are split over threads: a token
// verified among W proposals gets the very numbers it gets decoded alone.
#pragma once

#include <cstdint>

namespace pipeserve {

// One key / value head: position p's key at keys + p * key_step (dim contiguous floats),
// its value at values + p * value_step.
struct HeadKeysValues {
  const float* keys;
  const float* values;
  int64_t key_step, value_step;
  int dim;
};

// One query row's mask: position p's entry at base + p * step (boolean: false hides the
// position; additive: added to the score); base null: no mask.
struct QueryMask {
  const void* base = nullptr;
  int64_t step = 0;
  bool is_bool = false;
};

// out (dim) = softmax(scale * q . key[p] + mask[p] over p < seen) . value[p]; zeros where
// every position is masked (like MLX's sdpa).
void attend_query(const HeadKeysValues& head, const float* q, int seen, float scale,
                  const QueryMask& mask, float* out);

}  // namespace pipeserve
