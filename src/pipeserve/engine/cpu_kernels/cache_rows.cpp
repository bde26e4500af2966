// Rows of a batch's KV cache buffers as new, compact buffers: one op for all layers.
//
// When a row of a decoding batch finishes, mlx-lm's BatchKVCache.filter gathers every
// layer's keys and values (the whole capacity, MLX's generic gather: one op per buffer),
// and its extract copies the finished row's used positions for the prefix cache (two ops
// per buffer). On the CPU each op is a dispatch on the stream's thread, and MLX's
// scheduler lets only a few dozen be in flight: the engine thread then waits for the
// step in flight before it can queue the next one. Here the rows' used positions of every
// buffer are copied in one op (memcpy per row and head, split over the kernels' pool);
// the capacity after them is zeroed (a later roll of the buffer, as speculative decoding
// does, may bring it into the masked left padding, where a NaN would still poison the
// attention's weighted sum).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include "kernels.h"

namespace pipeserve {

namespace {

std::atomic<int64_t> copied_cache_bytes{0};

void fail(const std::string& message) {
  throw std::invalid_argument("cache_rows: " + message);
}

// One buffer's part of the job: raw pointers and strides (elements).
struct Block {
  const float* in;
  float* out;
  int64_t stride_b, stride_h, stride_p, stride_d;
  int heads, depth;
};

class CacheRows : public mx::Primitive {
 public:
  CacheRows(mx::Stream stream, std::vector<int> rows, int start, int stop, int capacity)
      : mx::Primitive(stream),
        rows_(std::move(rows)),
        start_(start),
        stop_(stop),
        capacity_(capacity) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<Block> blocks;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& in = inputs[i];
      encoder.set_input_array(in);
      outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
      encoder.set_output_array(outputs[i]);
      const auto& st = in.strides();
      blocks.push_back({in.data<float>(), outputs[i].data<float>(), st[0], st[1], st[2], st[3],
                        in.shape(1), in.shape(3)});
    }
    encoder.dispatch([blocks = std::move(blocks), rows = rows_, start = start_, stop = stop_,
                      capacity = capacity_]() {
      const int R = static_cast<int>(rows.size());
      int64_t tasks_per_buffer = 0;
      std::vector<int64_t> first;  // each buffer's first task
      for (const auto& b : blocks) {
        first.push_back(tasks_per_buffer);
        tasks_per_buffer += static_cast<int64_t>(R) * b.heads;
      }
      auto copy = [&](int64_t task) {
        const size_t i = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
        const Block& b = blocks[i];
        const int64_t local = task - first[i];
        const int r = static_cast<int>(local / b.heads), h = static_cast<int>(local % b.heads);
        const float* in = b.in + rows[r] * b.stride_b + h * b.stride_h;
        float* out = b.out + (static_cast<size_t>(r) * b.heads + h) * capacity * b.depth;
        const int used = stop - start;
        if (b.stride_d == 1 && b.stride_p == b.depth) {
          std::memcpy(out, in + start * b.stride_p, sizeof(float) * used * b.depth);
        } else {
          for (int p = 0; p < used; ++p) {
            const float* src = in + (start + p) * b.stride_p;
            for (int d = 0; d < b.depth; ++d) out[p * b.depth + d] = src[d * b.stride_d];
          }
        }
        std::memset(out + static_cast<size_t>(used) * b.depth, 0,
                    sizeof(float) * (capacity - used) * b.depth);
      };
      const int64_t total = tasks_per_buffer;
      const int chunks = static_cast<int>(std::min<int64_t>(total, 4 * threads()));
      parallel_for(chunks, [&](int c) {
        for (int64_t t = total * c / chunks; t < total * (c + 1) / chunks; ++t) copy(t);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("cache_rows runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveCacheRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CacheRows&>(other);
    return rows_ == o.rows_ && start_ == o.start_ && stop_ == o.stop_ &&
        capacity_ == o.capacity_;
  }

 private:
  std::vector<int> rows_;
  int start_, stop_, capacity_;
};

}  // namespace

void count_cache_copy(int64_t bytes) {
  copied_cache_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

int64_t cache_copy_bytes() {
  return copied_cache_bytes.load(std::memory_order_relaxed);
}

std::vector<mx::array> cache_rows(const std::vector<mx::array>& buffers,
                                  const std::vector<int>& rows, int start, int stop,
                                  int capacity, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  if (buffers.empty() || rows.empty()) fail("no buffers or no rows");
  if (start < 0 || stop < start || capacity < stop - start) {
    fail("need 0 <= start <= stop and stop - start <= capacity");
  }
  std::vector<mx::Shape> shapes;
  for (const auto& b : buffers) {
    if (b.dtype() != mx::float32 || b.ndim() != 4 || stop > b.shape(2)) {
      fail("buffers must be float32 (B, heads, capacity, depth) with stop <= capacity");
    }
    for (int r : rows) {
      if (r < 0 || r >= b.shape(0)) fail("row " + std::to_string(r) + " out of range");
    }
    shapes.push_back({static_cast<int>(rows.size()), b.shape(1), capacity, b.shape(3)});
  }
  std::vector<mx::Dtype> dtypes(buffers.size(), mx::float32);
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<CacheRows>(stream, rows, start, stop, capacity), buffers);
}

}  // namespace pipeserve
