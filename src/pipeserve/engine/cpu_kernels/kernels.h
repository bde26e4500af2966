// The ops pipeserve's CPU extension adds to MLX (bindings.cpp exposes them to Python).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <tuple>

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
// (B, Hq, L, S). merge_heads: out (B, L, Hq * D) instead of (B, Hq, L, D); causal:
// query row l sees keys up to position S - L + l (and the mask, if any).
mx::array sdpa(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::optional<mx::array>& mask,
    bool merge_heads = false,
    bool causal = false,
    mx::StreamOrDevice s = {});

// h = x + residual and rms_norm(h) * weight in one pass, float32 (fused_step.cpp).
std::tuple<mx::array, mx::array> add_rms_norm(
    const mx::array& x,
    const mx::array& residual,
    const mx::array& weight,
    float eps,
    mx::StreamOrDevice s = {});

// silu(gate) * up of a fused projection (..., 2I), gate half first (fused_step.cpp).
mx::array swiglu(const mx::array& gate_up, mx::StreamOrDevice s = {});

// A fused q/k/v projection (B, L, (Hq + 2 Hk) * D) split into q (B, Hq, L, D) and k, v
// (B, Hk, L, D), q and k normalised per head (optional weights) and rotated like
// mx.fast.rope (offset: int32, 1 or B positions) (fused_step.cpp).
std::tuple<mx::array, mx::array, mx::array> split_heads(
    const mx::array& qkv,
    int q_heads,
    int kv_heads,
    int rope_dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm,
    float eps,
    mx::StreamOrDevice s = {});

// Runs job(0) .. job(chunks - 1) on the kernels' thread pool (affine_qmm.cpp), the
// calling thread included, and returns when all are done; rethrows a job's exception.
void parallel_for(int chunks, const std::function<void(int)>& job);

void set_threads(int threads);
int threads();
std::string simd_name();

}  // namespace pipeserve
