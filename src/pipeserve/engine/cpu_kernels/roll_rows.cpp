// A speculative verification's rollback of a batch's KV cache buffers: one op for all
// layers (engine/kv/rows.py, trim_rows).
//
// After a verification, rows that accepted fewer proposed tokens hold more stale
// positions at the end of their cache. BatchKVCache keeps one end for all rows, so those
// rows move right by the difference (their left padding grows). mlx-lm's dynamic_roll
// does it with a gather of every layer's whole buffer, every row, the whole capacity:
// at batch 8 and an editing context that was more than a decode step's time. Here only
// the moving rows' used positions move (a memmove per row and head, split over the
// kernels' pool), in place where the buffer may be donated. Positions a row leaves
// behind become its left padding (masked) and keep their old, finite values.

#include <algorithm>
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

void fail(const std::string& message) {
  throw std::invalid_argument("roll_rows: " + message);
}

struct Moves {
  std::vector<int> shifts;  // per row: positions to move right (0: stays)
  std::vector<int> starts;  // per row: its first used position
  int stop;                 // the rows' common end
};

// One buffer as raw pointers: `in` any strides; `out` (B, heads, capacity, depth)
// contiguous, == in where donated.
struct Buffer {
  const float* in;
  float* out;
  int64_t stride_b, stride_h, stride_p, stride_d;
  int rows, heads, capacity, depth;
};

// Row r, head h of a new buffer: a copy of the input's.
void copy_head(const Buffer& b, int r, int h) {
  const float* in = b.in + r * b.stride_b + h * b.stride_h;
  float* out = b.out + (static_cast<size_t>(r) * b.heads + h) * b.capacity * b.depth;
  for (int p = 0; p < b.capacity; ++p) {
    for (int d = 0; d < b.depth; ++d) out[p * b.depth + d] = in[p * b.stride_p + d * b.stride_d];
  }
}

void move_head(const Buffer& b, const Moves& m, int r, int h) {
  if (b.out != b.in) copy_head(b, r, h);
  const int shift = m.shifts[r], start = m.starts[r];
  if (shift == 0 || m.stop - shift <= start) return;
  float* head = b.out + (static_cast<size_t>(r) * b.heads + h) * b.capacity * b.depth;
  std::memmove(head + static_cast<size_t>(start + shift) * b.depth,
               head + static_cast<size_t>(start) * b.depth,
               sizeof(float) * (m.stop - shift - start) * b.depth);
}

void run(const std::vector<Buffer>& buffers, const Moves& m) {
  std::vector<std::pair<int, int>> tasks;  // (buffer, head): every row of it
  for (int i = 0; i < static_cast<int>(buffers.size()); ++i) {
    for (int h = 0; h < buffers[i].heads; ++h) tasks.push_back({i, h});
  }
  const int total = static_cast<int>(tasks.size());
  const int chunks = std::min(total, 4 * threads());
  parallel_for(chunks, [&](int c) {
    for (int t = static_cast<int>(int64_t{total} * c / chunks);
         t < static_cast<int>(int64_t{total} * (c + 1) / chunks); ++t) {
      const auto [i, h] = tasks[t];
      for (int r = 0; r < buffers[i].rows; ++r) move_head(buffers[i], m, r, h);
    }
  });
}

class RollRows : public CacheBufferOp {
 public:
  RollRows(mx::Stream stream, Moves moves) : CacheBufferOp(stream), moves_(std::move(moves)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    release_sibling_inputs(inputs, outputs);
    std::vector<Buffer> buffers;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& in = inputs[i];
      auto& out = outputs[i];
      encoder.set_input_array(in);
      if (in.flags().row_contiguous && in.is_donatable() && !in.is_tracer()) {
        out.copy_shared_buffer(in);
      } else {
        out.set_data(mx::allocator::malloc(out.nbytes()));
      }
      encoder.set_output_array(out);
      const auto& st = in.strides();
      buffers.push_back({in.data<float>(), out.data<float>(), st[0], st[1], st[2], st[3],
                         in.shape(0), in.shape(1), in.shape(2), in.shape(3)});
    }
    encoder.dispatch([buffers = std::move(buffers), moves = moves_]() { run(buffers, moves); });
  }

  const char* name() const override {
    return "PipeserveRollRows";
  }

 private:
  Moves moves_;
};

}  // namespace

std::vector<mx::array> roll_rows(const std::vector<mx::array>& buffers,
                                 const std::vector<int>& shifts, const std::vector<int>& starts,
                                 int stop, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  if (buffers.empty()) fail("no buffers");
  if (shifts.size() != starts.size()) fail("one shift and one start per row");
  std::vector<mx::Shape> shapes;
  for (const auto& b : buffers) {
    if (b.dtype() != mx::float32 || b.ndim() != 4 || stop > b.shape(2) ||
        b.shape(0) != static_cast<int>(shifts.size())) {
      fail("buffers must be float32 (rows, heads, capacity, depth) with stop <= capacity");
    }
    shapes.push_back(b.shape());
  }
  for (size_t r = 0; r < shifts.size(); ++r) {
    if (shifts[r] < 0 || starts[r] < 0 || starts[r] > stop) {
      fail("row " + std::to_string(r) + ": need shift >= 0 and 0 <= start <= stop");
    }
  }
  std::vector<mx::Dtype> dtypes(buffers.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<RollRows>(stream, Moves{shifts, starts, stop}),
                                buffers);
}

}  // namespace pipeserve
