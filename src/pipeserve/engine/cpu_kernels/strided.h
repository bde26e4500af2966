// Row addressing shared by the fused ops (fused.cpp, fused_step.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/common/utils.h"

namespace pipeserve {

// Offset of each row's first element (a row: the last axis), for any strides.
inline std::vector<int64_t> row_offsets(const mlx::core::array& a) {
  const int cols = a.shape(-1);
  const size_t rows = cols == 0 ? 0 : a.size() / cols;
  std::vector<int64_t> out(rows);
  for (size_t r = 0; r < rows; ++r) {
    out[r] = a.flags().row_contiguous ? static_cast<int64_t>(r) * cols
                                      : mlx::core::elem_to_loc(static_cast<int>(r * cols), a);
  }
  return out;
}

}  // namespace pipeserve
