// The glue of a llama-style layer as single CPU ops (used by lean_step.py): splitting a
// fused q/k/v projection into heads with the per-head norm and RoPE applied, the
// residual add with the following RMSNorm, and SwiGLU over a fused gate/up projection.
// Each replaces three to eleven MLX ops, and on the CPU every op is a dispatch on the
// stream's thread: in a small model's decode step those dispatches cost more than the
// arithmetic. Float32 only (the CPU layouts run float32).

#include <cmath>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "kernels.h"
#include "strided.h"

namespace pipeserve {

namespace {

void fail(const std::string& message) {
  throw std::invalid_argument(message);
}

void require_cpu_float32(const mx::Stream& stream, const mx::array& a, const char* op) {
  if (stream.device != mx::Device::cpu) fail(std::string(op) + " runs on the CPU only");
  if (a.dtype() != mx::float32) fail(std::string(op) + ": float32 only");
}

void allocate(std::vector<mx::array>& outputs, mx::cpu::CommandEncoder& encoder) {
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
}

// Sum of squares -> 1 / rms, for a row read with a stride.
inline float inverse_rms(const float* row, int64_t step, int d, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < d; ++i) sum += row[i * step] * row[i * step];
  return 1.0f / std::sqrt(sum / d + eps);
}

class CpuOnly : public mx::Primitive {
 public:
  explicit CpuOnly(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("pipeserve's fused step ops run on the CPU only");
  }
};

// h = x + r, n = rms_norm(h) * w: the residual add and the next norm in one pass.
class AddRmsNorm : public CpuOnly {
 public:
  AddRmsNorm(mx::Stream stream, float eps) : CpuOnly(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto &x = inputs[0], &r = inputs[1], &w = inputs[2];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    allocate(outputs, encoder);
    encoder.dispatch([xp = x.data<float>(), rp = r.data<float>(), wp = w.data<float>(),
                      hp = outputs[0].data<float>(), np = outputs[1].data<float>(),
                      xrows = row_offsets(x), rrows = row_offsets(r), xs = x.strides().back(),
                      rs = r.strides().back(), ws = w.strides().back(), d = x.shape(-1),
                      eps = eps_]() {
      for (size_t row = 0; row < xrows.size(); ++row) {
        const float* xr = xp + xrows[row];
        const float* rr = rp + rrows[row];
        float* h = hp + row * d;
        float* n = np + row * d;
        for (int i = 0; i < d; ++i) h[i] = xr[i * xs] + rr[i * rs];
        const float inv = inverse_rms(h, 1, d, eps);
        for (int i = 0; i < d; ++i) n[i] = h[i] * inv * wp[i * ws];
      }
    });
  }
  const char* name() const override {
    return "PipeserveAddRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AddRmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }

 private:
  float eps_;
};

// silu(gate) * up over a fused projection (..., 2I): the gate half first.
class SwiGlu : public CpuOnly {
 public:
  explicit SwiGlu(mx::Stream stream) : CpuOnly(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& x = inputs[0];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    allocate(outputs, encoder);
    encoder.dispatch([xp = x.data<float>(), op = outputs[0].data<float>(), rows = row_offsets(x),
                      step = x.strides().back(), half = x.shape(-1) / 2]() {
      swiglu_rows(xp, rows, step, half, op);
    });
  }
  const char* name() const override {
    return "PipeserveSwiGlu";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() /= 2;
    return {shape};
  }
};

struct HeadLayout {
  int q_heads, kv_heads, head_dim, rope_dims;
  bool traditional;
  float base, scale, eps;
  bool q_norm, k_norm;
};

// One head's vector: optional RMSNorm (weight w), then RoPE from the cos / sin tables.
void head_out(const float* in, int64_t step, float* out, const HeadLayout& h, const float* w,
              int64_t ws, bool rope, const float* cosv, const float* sinv) {
  const int d = h.head_dim;
  const float inv = w ? inverse_rms(in, step, d, h.eps) : 1.0f;
  for (int i = 0; i < d; ++i) out[i] = w ? in[i * step] * inv * w[i * ws] : in[i * step];
  if (!rope) return;
  const int half = h.rope_dims / 2;
  for (int i = 0; i < half; ++i) {
    const int i1 = h.traditional ? 2 * i : i;
    const int i2 = h.traditional ? 2 * i + 1 : i + half;
    const float x1 = out[i1], x2 = out[i2];
    out[i1] = x1 * cosv[i] - x2 * sinv[i];
    out[i2] = x1 * sinv[i] + x2 * cosv[i];
  }
}

// qkv (B, L, (Hq + 2 Hk) * D) -> q (B, Hq, L, D), k and v (B, Hk, L, D): q and k
// normalised per head when norm weights are given, then rotated.
class SplitHeads : public CpuOnly {
 public:
  SplitHeads(mx::Stream stream, HeadLayout layout) : CpuOnly(stream), h_(layout) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& x = inputs[0];
    const auto& positions = inputs[1];
    const float* qw = h_.q_norm ? inputs[2].data<float>() : nullptr;
    const float* kw = h_.k_norm ? inputs[h_.q_norm ? 3 : 2].data<float>() : nullptr;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    allocate(outputs, encoder);
    encoder.dispatch([xp = x.data<float>(), pos = positions.data<int32_t>(),
                      npos = static_cast<int>(positions.size()), qp = outputs[0].data<float>(),
                      kp = outputs[1].data<float>(), vp = outputs[2].data<float>(),
                      shape = x.shape(), strides = x.strides(), qw, kw,
                      qws = h_.q_norm ? inputs[2].strides().back() : 0,
                      kws = h_.k_norm ? inputs.back().strides().back() : 0, h = h_]() {
      const int B = shape[0], L = shape[1], D = h.head_dim, half = h.rope_dims / 2;
      const int64_t step = strides[2];
      std::vector<float> inv_freq(half), cosv(half), sinv(half);
      for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(h.base, -2.0f * i / h.rope_dims);
      for (int b = 0; b < B; ++b) {
        const int start = pos[npos == 1 ? 0 : b];
        for (int l = 0; l < L; ++l) {
          const float p = static_cast<float>(start + l) * h.scale;
          for (int i = 0; i < half; ++i) {
            cosv[i] = std::cos(p * inv_freq[i]);
            sinv[i] = std::sin(p * inv_freq[i]);
          }
          const float* row = xp + b * strides[0] + l * strides[1];
          for (int head = 0; head < h.q_heads + 2 * h.kv_heads; ++head) {
            const float* in = row + static_cast<int64_t>(head) * D * step;
            if (head < h.q_heads) {
              float* o = qp + ((static_cast<int64_t>(b) * h.q_heads + head) * L + l) * D;
              head_out(in, step, o, h, qw, qws, true, cosv.data(), sinv.data());
            } else if (head < h.q_heads + h.kv_heads) {
              const int kh = head - h.q_heads;
              float* o = kp + ((static_cast<int64_t>(b) * h.kv_heads + kh) * L + l) * D;
              head_out(in, step, o, h, kw, kws, true, cosv.data(), sinv.data());
            } else {
              const int vh = head - h.q_heads - h.kv_heads;
              float* o = vp + ((static_cast<int64_t>(b) * h.kv_heads + vh) * L + l) * D;
              head_out(in, step, o, h, nullptr, 0, false, nullptr, nullptr);
            }
          }
        }
      }
    });
  }
  const char* name() const override {
    return "PipeserveSplitHeads";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SplitHeads&>(other).h_;
    return o.q_heads == h_.q_heads && o.kv_heads == h_.kv_heads && o.head_dim == h_.head_dim &&
        o.rope_dims == h_.rope_dims && o.traditional == h_.traditional && o.base == h_.base &&
        o.scale == h_.scale && o.eps == h_.eps && o.q_norm == h_.q_norm && o.k_norm == h_.k_norm;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int B = inputs[0].shape(0), L = inputs[0].shape(1);
    return {{B, h_.q_heads, L, h_.head_dim},
            {B, h_.kv_heads, L, h_.head_dim},
            {B, h_.kv_heads, L, h_.head_dim}};
  }

 private:
  HeadLayout h_;
};

void check_norm_weight(const std::optional<mx::array>& w, int d, const char* what) {
  if (w && (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != d)) {
    fail(std::string("split_heads: ") + what + " must be float32 (head_dim,)");
  }
}

}  // namespace

std::tuple<mx::array, mx::array> add_rms_norm(
    const mx::array& x,
    const mx::array& residual,
    const mx::array& weight,
    float eps,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  for (const auto* a : {&x, &residual, &weight}) require_cpu_float32(stream, *a, "add_rms_norm");
  if (x.shape() != residual.shape() || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    fail("add_rms_norm: x and residual (..., D) of one shape, weight (D,)");
  }
  auto outs = mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                     std::make_shared<AddRmsNorm>(stream, eps),
                                     {x, residual, weight});
  return {outs[0], outs[1]};
}

mx::array swiglu(const mx::array& gate_up, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  require_cpu_float32(stream, gate_up, "swiglu");
  if (gate_up.ndim() < 1 || gate_up.shape(-1) % 2 != 0) fail("swiglu: last axis must be even");
  auto shape = gate_up.shape();
  shape.back() /= 2;
  return mx::array(shape, mx::float32, std::make_shared<SwiGlu>(stream), {gate_up});
}

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
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  require_cpu_float32(stream, qkv, "split_heads");
  const int heads = q_heads + 2 * kv_heads;
  if (qkv.ndim() != 3 || q_heads <= 0 || kv_heads <= 0 || qkv.shape(2) % heads != 0) {
    fail("split_heads: qkv must be (B, L, (q_heads + 2 kv_heads) * head_dim)");
  }
  const int head_dim = qkv.shape(2) / heads;
  if (rope_dims % 2 != 0 || rope_dims > head_dim) fail("split_heads: rope dims even, <= D");
  if (offset.size() != 1 && (offset.ndim() != 1 || offset.shape(0) != qkv.shape(0))) {
    fail("split_heads: offset must hold 1 or B positions");
  }
  check_norm_weight(q_norm, head_dim, "q_norm");
  check_norm_weight(k_norm, head_dim, "k_norm");
  auto positions = offset.dtype() == mx::int32 && offset.ndim() == 1
      ? offset
      : mx::reshape(mx::astype(offset, mx::int32, stream), {-1}, stream);
  std::vector<mx::array> inputs = {qkv, positions};
  if (q_norm) inputs.push_back(*q_norm);
  if (k_norm) inputs.push_back(*k_norm);
  HeadLayout layout{q_heads, kv_heads, head_dim, rope_dims, traditional, base, scale, eps,
                    q_norm.has_value(), k_norm.has_value()};
  const int B = qkv.shape(0), L = qkv.shape(1);
  auto outs = mx::array::make_arrays(
      {{B, q_heads, L, head_dim}, {B, kv_heads, L, head_dim}, {B, kv_heads, L, head_dim}},
      {mx::float32, mx::float32, mx::float32}, std::make_shared<SplitHeads>(stream, layout),
      inputs);
  return {outs[0], outs[1], outs[2]};
}

}  // namespace pipeserve
