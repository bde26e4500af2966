// Attention of one query row against one key / value head kept quantized in MLX's affine
// layout (what mlx-lm's QuantizedKVCache and the batch's BatchQuantizedKVCache hold:
// `options.kv_cache`), and the quantization of a new key / value row into that layout:
// the decoder-layer op's attention with a quantized cache (fused_layer.cpp).
//
// The same contract as attend_query (attention.h): a query's result depends only on its
// own q, keys, values, mask and `seen`.
#pragma once

#include <cstdint>

#include "attention.h"

namespace pipeserve {

// One head's rows of a quantized buffer triple: position p's packed codes at words + p *
// word_step (dim * bits / 32 uint32 words, code i at bits i * bits of the little-endian
// words, as mx.quantize packs them), its per-group scales and biases (float32, dim /
// group_size of each) at scales + p * group_step and biases + p * group_step.
struct QuantizedRows {
  const uint32_t* words;
  const float* scales;
  const float* biases;
  int64_t word_step, group_step;
};

struct QuantizedHead {
  QuantizedRows keys, values;
  int dim, group_size, bits;  // bits 4 or 8; group_size 32, 64 or 128 dividing dim
};

// out (dim) = softmax(scale * q . dequantize(key[p]) + mask[p] over p < seen) .
// dequantize(value[p]), dequantize(c) = scale_g * c + bias_g; zeros where every position
// is masked.
void attend_query_quantized(const QuantizedHead& head, const float* q, int seen, float scale,
                            const QueryMask& mask, float* out);

// One row of dim floats quantized as mx.quantize does on the CPU (bit for bit): words
// (dim * bits / 32), scales and biases (dim / group_size).
void quantize_row(const float* x, int dim, int group_size, int bits, uint32_t* words,
                  float* scales, float* biases);

// Whether attend_query_quantized / quantize_row take this shape.
bool quantized_shape_ok(int dim, int group_size, int bits);

}  // namespace pipeserve
