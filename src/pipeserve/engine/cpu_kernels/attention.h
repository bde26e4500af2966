// Attention of one query row against one key / value head on the CPU: the inner loop of
// the decoder-layer op (fused_layer.cpp: decode steps and speculative verifications) and
// of Sdpa (fused.cpp: short prefills).
//
// A query's result depends only on its own q, keys, values, mask and `seen`, never on the
// other rows or tokens of the step, nor on how queries are split over threads: a token
// verified among W proposals gets the very numbers it gets decoded alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

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

// scores[p] for p < seen with the mask applied (boolean: -inf where hidden; additive:
// added); shared by the float and the quantized attention.
void apply_mask(const QueryMask& mask, int seen, float* scores);

// out (dim) = softmax(scale * q . key[p] + mask[p] over p < seen) . value[p]; zeros where
// every position is masked (like MLX's sdpa).
void attend_query(const HeadKeysValues& head, const float* q, int seen, float scale,
                  const QueryMask& mask, float* out);

// Below this many multiply-adds an attention runs on the calling thread (a pool fork /
// join costs more).
constexpr int64_t PARALLEL_ATTENTION = 1 << 15;

// How sdpa and the decoder-layer op split attention over the kernels' pool: tasks of one
// (batch row, kv head) pair and a run of its `queries` query rows (the query heads of the
// kv head's group x the query positions), which read the same keys and values while they
// are in cache; a pair's queries are split into runs only where there are too few pairs
// to keep the pool busy. run(b, kh, first, last) does queries first..last - 1 of a pair,
// on the calling thread where `work` (multiply-adds) is below PARALLEL_ATTENTION.
void for_each_query_run(int batch, int kv_heads, int queries, int64_t work,
                        const std::function<void(int b, int kh, int first, int last)>& run);

}  // namespace pipeserve
