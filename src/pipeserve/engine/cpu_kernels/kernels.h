// The ops pipeserve's CPU extension adds to MLX (bindings.cpp exposes them to Python).
#pragma once

#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace pipeserve {

// x @ dequantize(w, scales, biases).T for MLX's affine layout, float32 out (affine_qmm.cpp).
mx::array affine_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// mx.fast.rms_norm as one CPU op, float32 (fused.cpp).
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

// mx.fast.rope as one CPU op, float32 (fused.cpp): x (B, H, L, D), any strides; offset an
// int32 array of 1 or B positions.
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    mx::StreamOrDevice s = {});

// Attention of a few query rows against a cache (fused.cpp): q (B, Hq, L, D), k and v
// (B, Hk, S, D), any strides; mask None, boolean or additive, broadcastable to
// (B, Hq, L, S).
mx::array sdpa(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s = {});

void set_threads(int threads);
int threads();
std::string simd_name();

}  // namespace pipeserve
