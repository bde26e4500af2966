// RMSNorm and RoPE as single CPU ops. On the CPU MLX runs mx.fast.rms_norm and
// mx.fast.rope as their fallbacks, five to ten small ops each, and every op costs a
// dispatch on the stream's thread: in a small model's decode step those dispatches,
// not the arithmetic, are most of the time. Float32 only (the CPU layouts run float32).

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "attention.h"
#include "prefill_attention.h"
#include "kernels.h"
#include "strided.h"

namespace pipeserve {

namespace {

void fail(const std::string& message) {
  throw std::invalid_argument(message);
}

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(),
                      offsets = row_offsets(x), step = x.strides().back(),
                      wstep = w.strides().back(), d = x.shape(-1), eps = eps_]() {
      for (size_t r = 0; r < offsets.size(); ++r) {
        const float* row = xp + offsets[r];
        float sum = 0.0f;
        for (int i = 0; i < d; ++i) sum += row[i * step] * row[i * step];
        const float inv = 1.0f / std::sqrt(sum / d + eps);
        float* o = op + r * d;
        for (int i = 0; i < d; ++i) o[i] = row[i * step] * inv * wp[i * wstep];
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("rms_norm runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& x = inputs[0];
    const auto& offset = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(offset);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<float>(), positions = offset.data<int32_t>(),
                      npos = static_cast<int>(offset.size()), op = out.data<float>(),
                      shape = x.shape(), strides = x.strides(), dims = dims_,
                      traditional = traditional_, base = base_, scale = scale_]() {
      const int B = shape[0], H = shape[1], L = shape[2], D = shape[3];
      const int half = dims / 2;
      std::vector<float> inv_freq(half), cosv(half), sinv(half);
      for (int i = 0; i < half; ++i) {
        inv_freq[i] = std::pow(base, -2.0f * i / dims);
      }
      for (int b = 0; b < B; ++b) {
        const int start = positions[npos == 1 ? 0 : b];
        for (int l = 0; l < L; ++l) {
          const float pos = static_cast<float>(start + l) * scale;
          for (int i = 0; i < half; ++i) {
            const float angle = pos * inv_freq[i];
            cosv[i] = std::cos(angle);
            sinv[i] = std::sin(angle);
          }
          for (int h = 0; h < H; ++h) {
            const float* in = xp + b * strides[0] + h * strides[1] + l * strides[2];
            const int64_t s = strides[3];
            float* o = op + ((static_cast<int64_t>(b) * H + h) * L + l) * D;
            for (int i = 0; i < half; ++i) {
              const int i1 = traditional ? 2 * i : i;
              const int i2 = traditional ? 2 * i + 1 : i + half;
              const float x1 = in[i1 * s], x2 = in[i2 * s];
              o[i1] = x1 * cosv[i] - x2 * sinv[i];
              o[i2] = x1 * sinv[i] + x2 * cosv[i];
            }
            for (int i = dims; i < D; ++i) o[i] = in[i * s];
          }
        }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("rope runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
        scale_ == o.scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

// Sdpa's work as raw pointers, split over the kernels' pool by for_each_query_run; each
// query row by attend_query (attention.cpp).
struct SdpaJob {
  const float *qp, *kp, *vp;
  float* op;
  mx::Strides qs, ks, vs;
  mx::Shape shape;  // q: (B, Hq, L, D)
  int S, Hk;
  const void* mp;
  mx::Strides ms;
  int kind;  // 0 no mask, 1 boolean, 2 additive
  float scale;
  bool merged, causal;

  // Row b's kv head kh, contiguous in `keys` / `values` unless already so.
  HeadKeysValues head(int b, int kh, std::vector<float>& keys, std::vector<float>& values) const {
    const int D = shape[3];
    const float* k = kp + b * ks[0] + kh * ks[1];
    const float* v = vp + b * vs[0] + kh * vs[1];
    auto gather = [&](const float* from, const mx::Strides& st, std::vector<float>& to) {
      to.resize(static_cast<size_t>(S) * D);
      for (int s = 0; s < S; ++s)
        for (int d = 0; d < D; ++d) to[s * D + d] = from[s * st[2] + d * st[3]];
      return to.data();
    };
    const bool k_rows = ks[3] == 1, v_rows = vs[3] == 1;
    return {k_rows ? k : gather(k, ks, keys), v_rows ? v : gather(v, vs, values),
            k_rows ? ks[2] : D, v_rows ? vs[2] : D, D};
  }

  void query(const HeadKeysValues& kv, int b, int h, int l, std::vector<float>& q_row) const {
    const int Hq = shape[1], L = shape[2], D = shape[3];
    const float* qr = qp + b * qs[0] + h * qs[1] + l * qs[2];
    if (qs[3] != 1) {
      q_row.resize(D);
      for (int d = 0; d < D; ++d) q_row[d] = qr[d * qs[3]];
      qr = q_row.data();
    }
    QueryMask mask;
    if (kind != 0) {
      const int64_t at = b * ms[0] + h * ms[1] + l * ms[2];
      mask.is_bool = kind == 1;
      mask.base = kind == 1 ? static_cast<const void*>(static_cast<const bool*>(mp) + at)
                            : static_cast<const void*>(static_cast<const float*>(mp) + at);
      mask.step = ms[3];
    }
    // causal: query row l sees the keys up to its own position, S - L + l
    const int seen = causal ? std::min(S, S - L + l + 1) : S;
    float* o = merged ? op + ((static_cast<int64_t>(b) * L + l) * Hq + h) * D
                      : op + ((static_cast<int64_t>(b) * Hq + h) * L + l) * D;
    attend_query(kv, qr, seen, scale, mask, o);
  }

  // A prompt chunk (no mask or a boolean one): the blocked kernel (prefill_attention.cpp).
  bool blocked() const {
    const int B = shape[0], Hq = shape[1], L = shape[2], D = shape[3];
    if (kind == 2 || qs[3] != 1 || ks[3] != 1 || vs[3] != 1) return false;
    const int64_t ob = merged ? int64_t{L} * Hq * D : int64_t{Hq} * L * D;
    PrefillAttention a{qp, kp, vp, op, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0],
                       vs[1], vs[2], ob, merged ? D : int64_t{L} * D,
                       merged ? int64_t{Hq} * D : D, B, Hq, Hk, L, S, D, scale, causal};
    if (kind == 1) {
      a.mask = static_cast<const bool*>(mp);
      a.m_b = ms[0], a.m_h = ms[1], a.m_l = ms[2], a.m_s = ms[3];
    }
    return prefill_attention(a);
  }

  void run() const {
    const int B = shape[0], Hq = shape[1], L = shape[2], D = shape[3];
    if (blocked()) return;
    const int group = Hq / Hk;
    const int64_t work = static_cast<int64_t>(B) * Hq * L * S * D;
    for_each_query_run(B, Hk, L * group, work, [&](int b, int kh, int first, int last) {
      thread_local std::vector<float> keys, values, q_row;
      const HeadKeysValues kv = head(b, kh, keys, values);
      for (int i = first; i < last; ++i) query(kv, b, kh * group + i / L, i % L, q_row);
    });
  }
};

// Attention for a few query rows (a decode step) or a short prefill (causal): per
// (batch, query head) the scores against every key of its kv head (grouped-query), the
// mask, a float32 softmax and the weighted sum of values (attend_query), split over the
// kernels' pool. Keys and values as the cache slices them (any strides); the mask
// broadcast to (B, Hq, L, S), boolean or additive.
class Sdpa : public mx::Primitive {
 public:
  Sdpa(mx::Stream stream, float scale, int mask_kind, bool merge_heads, bool causal)
      : mx::Primitive(stream),
        scale_(scale),
        mask_kind_(mask_kind),
        merge_heads_(merge_heads),
        causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const mx::array* mask = mask_kind_ == 0 ? nullptr : &inputs[3];
    SdpaJob job{q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                q.strides(), k.strides(), v.strides(), q.shape(), static_cast<int>(k.shape(2)),
                static_cast<int>(k.shape(1)), mask ? mask->data<void>() : nullptr,
                mask ? mask->strides() : mx::Strides{}, mask_kind_, scale_, merge_heads_,
                causal_};
    encoder.dispatch([job = std::move(job)]() { job.run(); });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sdpa runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveSdpa";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Sdpa&>(other);
    return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && merge_heads_ == o.merge_heads_ &&
        causal_ == o.causal_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {out_shape(inputs[0].shape(), merge_heads_)};
  }
  static mx::Shape out_shape(const mx::Shape& q, bool merge_heads) {
    return merge_heads ? mx::Shape{q[0], q[2], q[1] * q[3]} : q;
  }

 private:
  float scale_;
  int mask_kind_;  // 0 none, 1 boolean (false: masked out), 2 additive float32
  bool merge_heads_;  // out (B, L, Hq * D), the layout the output projection takes
  bool causal_;  // query row l also sees no key after position S - L + l
};

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("rms_norm runs on the CPU only");
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32) fail("rms_norm: float32 only");
  if (weight.ndim() != 1 || x.ndim() < 1 || weight.shape(0) != x.shape(-1)) {
    fail("rms_norm: weight must be (D,) for x (..., D)");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps), {x, weight});
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("rope runs on the CPU only");
  if (x.dtype() != mx::float32) fail("rope: float32 only");
  if (x.ndim() != 4) fail("rope: x must be (B, H, L, D)");
  if (dims % 2 != 0 || dims > x.shape(3)) fail("rope: dims must be even and at most D");
  if (offset.size() != 1 && (offset.ndim() != 1 || offset.shape(0) != x.shape(0))) {
    fail("rope: offset must hold 1 or B positions");
  }
  auto positions = offset.dtype() == mx::int32 && offset.ndim() == 1
      ? offset
      : mx::reshape(mx::astype(offset, mx::int32, stream), {-1}, stream);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(stream, dims, traditional, base, scale), {x, positions});
}

}  // namespace pipeserve

namespace pipeserve {

mx::array sdpa(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::optional<mx::array>& mask,
    bool merge_heads,
    bool causal,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("sdpa runs on the CPU only");
  for (const auto* a : {&q, &k, &v}) {
    if (a->dtype() != mx::float32 || a->ndim() != 4) fail("sdpa: float32 (B, H, L, D) inputs");
  }
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      q.shape(1) % k.shape(1) != 0) {
    fail("sdpa: k and v must be (B, Hk, S, D) with Hq a multiple of Hk");
  }
  std::vector<mx::array> inputs = {q, k, v};
  int kind = 0;
  if (mask) {
    mx::Shape full = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    if (mask->dtype() == mx::bool_) {
      kind = 1;
      inputs.push_back(mx::broadcast_to(*mask, full, stream));
    } else {
      kind = 2;
      inputs.push_back(mx::broadcast_to(mx::astype(*mask, mx::float32, stream), full, stream));
    }
  }
  return mx::array(Sdpa::out_shape(q.shape(), merge_heads), mx::float32,
                   std::make_shared<Sdpa>(stream, scale, kind, merge_heads, causal), inputs);
}

}  // namespace pipeserve
