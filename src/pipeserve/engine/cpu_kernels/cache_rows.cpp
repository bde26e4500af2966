// Rows of a batch's KV cache buffers as compact buffers: one op for all layers.
//
// When a row of a decoding batch finishes, mlx-lm's BatchKVCache.filter gathers every
// layer's keys and values (the whole capacity, MLX's generic gather: one op per buffer),
// and its extract copies the finished row's used positions for the prefix cache (two ops
// per buffer). On the CPU each op is a dispatch on the stream's thread, and MLX's
// scheduler lets only a few dozen be in flight: the engine thread then waits for the
// step in flight before it can queue the next one. Here every buffer's rows are done by
// one op, split over the kernels' pool:
// - where a buffer may be donated (contiguous, nothing else holds it, the same capacity
//   asked for) and at least half its rows are kept, in place: each kept row's used positions move down to its new row and
//   position 0 (memmove, rows in ascending order: a row's new place is never a later
//   row's source), and the output is the buffer's first rows. Nothing is allocated; the
//   room after a moved row keeps its old, finite contents (never read: attention stops at
//   the cache's index);
// - otherwise the rows' used positions are copied into a new buffer whose room is zeroed
//   (a speculative rollback's roll may bring it into the masked left padding, where a
//   NaN would still poison the attention's weighted sum).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include "donation.h"
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
  float* out;  // == in: rows moved in place
  int64_t stride_b, stride_h, stride_p, stride_d;
  int heads, depth;
};

struct Span {
  std::vector<int> rows;
  int start, stop, capacity;
};

// Row r of the output, head h: the source row's positions start..stop - 1 at 0.., then
// zeros up to the capacity (a new buffer only).
void copy_row(const Block& b, const Span& span, int r, int h) {
  const int used = span.stop - span.start;
  const float* in = b.in + span.rows[r] * b.stride_b + h * b.stride_h + span.start * b.stride_p;
  float* out = b.out + (static_cast<size_t>(r) * b.heads + h) * span.capacity * b.depth;
  if (b.out == b.in) {  // in place: contiguous, and the source is never below the target
    if (out != in) std::memmove(out, in, sizeof(float) * used * b.depth);
    return;
  }
  if (b.stride_d == 1 && b.stride_p == b.depth) {
    std::memcpy(out, in, sizeof(float) * used * b.depth);
  } else {
    for (int p = 0; p < used; ++p) {
      for (int d = 0; d < b.depth; ++d) out[p * b.depth + d] = in[p * b.stride_p + d * b.stride_d];
    }
  }
  std::memset(out + static_cast<size_t>(used) * b.depth, 0,
              sizeof(float) * (span.capacity - used) * b.depth);
}

void run(const std::vector<Block>& blocks, const Span& span) {
  const int R = static_cast<int>(span.rows.size());
  // Tasks: (buffer, head) pairs; rows in ascending order within a task (in place, row r's
  // target may be an earlier row's source).
  std::vector<std::pair<int, int>> tasks;
  for (int i = 0; i < static_cast<int>(blocks.size()); ++i) {
    for (int h = 0; h < blocks[i].heads; ++h) tasks.push_back({i, h});
  }
  const int total = static_cast<int>(tasks.size());
  const int chunks = std::min(total, 4 * threads());
  parallel_for(chunks, [&](int c) {
    for (int t = static_cast<int>(int64_t{total} * c / chunks);
         t < static_cast<int>(int64_t{total} * (c + 1) / chunks); ++t) {
      const auto [i, h] = tasks[t];
      for (int r = 0; r < R; ++r) copy_row(blocks[i], span, r, h);
    }
  });
}

class CacheRows : public CacheBufferOp {
 public:
  CacheRows(mx::Stream stream, Span span) : CacheBufferOp(stream), span_(std::move(span)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    release_sibling_inputs(inputs, outputs);
    std::vector<Block> blocks;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& in = inputs[i];
      auto& out = outputs[i];
      encoder.set_input_array(in);
      // In place keeps the whole allocation (earlier moves in place kept theirs too): only
      // while the kept rows fill at least half of it (a new buffer returns the memory of
      // many finished rows).
      const bool in_place = in.flags().row_contiguous && in.is_donatable() &&
          in.shape(2) == span_.capacity && !in.is_tracer() &&
          2 * out.nbytes() >= in.buffer_size();
      if (in_place) {
        auto flags = in.flags();
        flags.col_contiguous = out.size() <= 1;
        out.copy_shared_buffer(in, contiguous_strides(out), flags, out.size());
      } else {
        out.set_data(mx::allocator::malloc(out.nbytes()));
      }
      encoder.set_output_array(out);
      const auto& st = in.strides();
      blocks.push_back({in.data<float>(), out.data<float>(), st[0], st[1], st[2], st[3],
                        in.shape(1), in.shape(3)});
    }
    encoder.dispatch([blocks = std::move(blocks), span = span_]() { run(blocks, span); });
  }

  const char* name() const override {
    return "PipeserveCacheRows";
  }

 private:
  Span span_;
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
  if (!std::is_sorted(rows.begin(), rows.end()) ||
      std::adjacent_find(rows.begin(), rows.end()) != rows.end()) {
    fail("rows must be ascending");
  }
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
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<CacheRows>(stream, Span{rows, start, stop, capacity}),
                                buffers);
}

}  // namespace pipeserve
