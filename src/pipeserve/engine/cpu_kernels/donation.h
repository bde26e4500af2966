// Letting a multi-output op reuse (donate) its input buffers: shared by the ops that
// rewrite KV cache buffers (cache_rows.cpp, roll_rows.cpp).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace pipeserve {

// Row-contiguous strides of `a`'s shape.
inline mlx::core::Strides contiguous_strides(const mlx::core::array& a) {
  mlx::core::Strides strides(a.ndim(), 1);
  for (int axis = a.ndim() - 2; axis >= 0; --axis) {
    strides[axis] = strides[axis + 1] * a.shape(axis + 1);
  }
  return strides;
}

// Each output of a multi-output op holds its own copy of the inputs (make_arrays), so
// no input would look donatable (is_donatable: one holder). The other outputs' copies
// are dropped here: MLX clears every sibling's inputs once the op is evaluated anyway
// (array::detach). Not for tracers (compile, transforms).
inline void release_sibling_inputs(const std::vector<mlx::core::array>& inputs,
                                   std::vector<mlx::core::array>& outputs) {
  for (auto& out : outputs) {
    if (out.is_tracer()) return;
  }
  for (auto& out : outputs) {
    auto& held = out.inputs();
    if (&held != &inputs) held.clear();
  }
}

// An op that rewrites KV cache buffers, on the CPU only; it may write its inputs' buffers,
// so it is never merged with another.
class CacheBufferOp : public mlx::core::Primitive {
 public:
  using mlx::core::Primitive::Primitive;
  void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }
  bool is_equivalent(const mlx::core::Primitive&) const override {
    return false;
  }
};

}  // namespace pipeserve
