// pipeserve's CPU kernel: y = x @ dequantize(w).T for MLX's affine quantized layout,
// without ever expanding w. An MLX extension: a Primitive whose eval_cpu queues the
// kernel on the stream's CPU command encoder; Python binding through nanobind.
//
// Layout (MLX affine, the layout GGUF conversions already produce): w is uint32
// (N, K * bits / 32), value i of a row at bits i * bits.. of the row's little-endian
// bit stream; scales and biases (N, K / group_size) in float16 or float32; weight
// (n, k) = scale * q + bias. The product per output is
//     sum_g scale[n, g] * (q[n, g] . x[m, g]) + sum_g bias[n, g] * sum(x[m, g])
// with the group sums of x computed once per call. Float32 accumulation, except for
// up to INT_MAX_M rows of x on AVX-512, which run exact integer dot products on x
// split into two int16 parts (as precise as float32; see "Few activation rows").
//
// SIMD: AVX-512 (16 lanes) or AVX2/FMA (8 lanes), picked by the compiler flags the
// build chose from this CPU's features (the build cache is keyed by them), with a
// scalar form for anything else. Output rows are split across a small thread pool.

#include <immintrin.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "kernels.h"

namespace pipeserve {

// ---------------------------------------------------------------------------
// Thread pool. A call is cut into chunks that threads claim one at a time (an atomic
// counter of the call's own), the calling thread included: on a busy machine where a
// worker is not scheduled, the caller simply does every chunk itself instead of
// waiting for it. Each call's counters live in their own shared object, so a worker
// that wakes late can never touch another call's count. Workers spin briefly between
// calls (a decode step issues its matmuls microseconds apart), then sleep.
//
// Every claimed chunk is counted done even when its job throws (the first exception is
// kept and rethrown by the caller once no thread can still be inside the job), so the
// caller's wait always ends and a worker never lets an exception escape (terminate).
// A pool belongs to the process that made it: after a fork (gunicorn's workers) its
// threads do not exist in the child, so pool() builds a new one there.
// ---------------------------------------------------------------------------

struct Call {
  const std::function<void(int)>* job;
  int chunks;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;  // the first job exception, guarded by error_mu
};

void run_chunk(Call& call, int chunk) {
  if (call.failed.load(std::memory_order_relaxed)) return;  // the call is lost anyway
  try {
    (*call.job)(chunk);
  } catch (...) {
    std::lock_guard<std::mutex> lock(call.error_mu);
    if (!call.error) call.error = std::current_exception();
    call.failed.store(true, std::memory_order_relaxed);
  }
}

// Claims and runs chunks of `call` until none is left.
void drain(Call& call) {
  for (int i = call.next.fetch_add(1); i < call.chunks; i = call.next.fetch_add(1)) {
    run_chunk(call, i);
    call.done.fetch_add(1, std::memory_order_release);
  }
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)), owner_(getpid()) {
    for (int i = 1; i < threads_; ++i) {
      workers_.emplace_back([this] { work(); });
    }
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const {
    return threads_;
  }
  pid_t owner() const {
    return owner_;
  }

  // Runs job(0) .. job(chunks - 1), each exactly once, on any of the threads, and
  // rethrows the first exception a job threw. Calls from several threads (MLX has a
  // stream per thread) take turns.
  void run(int chunks, const std::function<void(int)>& job) {
    if (chunks <= 1 || threads_ == 1) {
      for (int i = 0; i < chunks; ++i) job(i);
      return;
    }
    std::lock_guard<std::mutex> turn(call_mu_);
    auto call = std::make_shared<Call>();
    call->job = &job;
    call->chunks = chunks;
    publish(call);
    if (sleeping_.load() > 0) wake_.notify_all();
    drain(*call);
    for (int spin = 0; call->done.load(std::memory_order_acquire) != chunks; ++spin) {
      if (spin < 64) {
        _mm_pause();
      } else {
        std::this_thread::yield();  // a preempted worker holds a chunk
      }
    }
    publish(nullptr);  // no late worker may reach `job`, which dies with this frame
    if (call->error) std::rethrow_exception(call->error);
  }

 private:
  void publish(std::shared_ptr<Call> call) {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = std::move(call);
    if (current_) generation_.fetch_add(1, std::memory_order_release);
  }

  void work() {
    uint64_t seen = 0;
    while (true) {
      uint64_t now = generation_.load(std::memory_order_acquire);
      for (int spin = 0; now == seen && spin < 4000; ++spin) {
        _mm_pause();
        now = generation_.load(std::memory_order_acquire);
      }
      std::shared_ptr<Call> call;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (generation_.load() == seen) {
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
        if (stop_) return;
        seen = generation_.load();
        call = current_;
      }
      if (call) drain(*call);
    }
  }

  int threads_;
  pid_t owner_;  // the process whose threads these are
  std::vector<std::thread> workers_;
  std::mutex mu_;  // guards current_, stop_ and the sleep
  std::mutex call_mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Call> current_;
  std::atomic<int> sleeping_{0};
  bool stop_ = false;
};

// Shared so that set_threads replacing the pool cannot free one another thread is in.
static std::shared_ptr<Pool> pool_;
static int pool_threads_ = 1;
static std::mutex pool_mu_;

// Held across fork() so that the child never inherits pool_mu_ locked.
void register_fork_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork([] { pool_mu_.lock(); }, [] { pool_mu_.unlock(); }, [] { pool_mu_.unlock(); });
  });
}

std::shared_ptr<Pool> pool() {
  register_fork_handlers();
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (pool_ && pool_->owner() != getpid()) {
    // Made before a fork: its workers (and maybe a half-done call, locked mutexes) live
    // only in the parent. Never destroyed here: joining threads this process does not
    // have is undefined, so it is left allocated.
    new std::shared_ptr<Pool>(std::move(pool_));
  }
  if (!pool_) pool_ = std::make_shared<Pool>(pool_threads_);
  return pool_;
}

void parallel_for(int chunks, const std::function<void(int)>& job) {
  pool()->run(chunks, job);
}

void set_threads(int threads) {
  register_fork_handlers();
  std::shared_ptr<Pool> old;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    pool_threads_ = std::max(1, threads);
    old = std::move(pool_);
    if (old && old->owner() != getpid()) new std::shared_ptr<Pool>(std::move(old));
    pool_ = std::make_shared<Pool>(pool_threads_);
  }
  // `old` is joined here, outside the lock, once no running call holds it any more.
}

// ---------------------------------------------------------------------------
// Scale types and unpacking of 32 quantized values to floats.
// ---------------------------------------------------------------------------

inline float to_float(float v) {
  return v;
}
inline float to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// 32 values of a group chunk as unsigned bytes (natural order) in two 16-byte halves.
template <int BITS>
inline void unpack_bytes(const uint8_t* p, uint8_t out[32]) {
  if constexpr (BITS == 8) {
    std::memcpy(out, p, 32);
  } else {
    for (int i = 0; i < 32; ++i) {
      int bit = i * BITS;
      uint32_t word = 0;
      std::memcpy(&word, p + bit / 8, (bit % 8 + BITS + 7) / 8);
      out[i] = (word >> (bit % 8)) & ((1u << BITS) - 1);
    }
  }
}

// Values 8k .. 8k + 7 of a run of 5-bit values (5 bytes hold 8 values), one per byte:
// pdep spreads each field into its own byte. Whole 8-byte loads; the run's `last` eight
// are loaded 3 bytes early and shifted down, so no load reads past the run.
inline uint64_t five_bit_word(const uint8_t* p, int k, bool last) {
  uint64_t raw;
  std::memcpy(&raw, p + (last ? 5 * k - 3 : 5 * k), 8);
  if (last) raw >>= 24;
#if defined(__BMI2__)
  return _pdep_u64(raw, 0x1f1f1f1f1f1f1f1fULL);
#else
  uint64_t spread = 0;
  for (int i = 0; i < 8; ++i) spread |= ((raw >> (5 * i)) & 0x1f) << (8 * i);
  return spread;
#endif
}

#if defined(__AVX2__)
// Two __m128i of 16 unsigned bytes each: values 0-15 and 16-31 of a 32-value chunk.
template <int BITS>
inline void unpack_halves(const uint8_t* p, __m128i& a, __m128i& b) {
  if constexpr (BITS == 8) {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  } else if constexpr (BITS == 4) {
    // byte j holds value 2j (low nibble) and 2j + 1 (high nibble)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    a = _mm_unpacklo_epi8(lo, hi);
    b = _mm_unpackhi_epi8(lo, hi);
  } else {
    // 5 bytes hold 8 values; pdep spreads each 5-bit field into its own byte. Whole
    // 8-byte loads inside the chunk's 20 bytes (the last one shifted down): a 5-byte
    // memcpy per 8 values made this width 14x slower than the others.
    uint64_t u[4];
    for (int k = 0; k < 4; ++k) u[k] = five_bit_word(p, k, k == 3);
    a = _mm_set_epi64x(static_cast<long long>(u[1]), static_cast<long long>(u[0]));
    b = _mm_set_epi64x(static_cast<long long>(u[3]), static_cast<long long>(u[2]));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int LANES = 16;
using Vec = __m512;
inline Vec vzero() {
  return _mm512_setzero_ps();
}
inline Vec vset1(float v) {
  return _mm512_set1_ps(v);
}
inline Vec vload(const float* p) {
  return _mm512_loadu_ps(p);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return _mm512_fmadd_ps(a, b, c);
}
inline Vec vmul(Vec a, Vec b) {
  return _mm512_mul_ps(a, b);
}
inline float vsum(Vec v) {
  return _mm512_reduce_add_ps(v);
}
inline Vec bytes_to_floats(__m128i b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}
template <int BITS>
inline void unpack(const uint8_t* p, Vec q[32 / LANES]) {
  __m128i a, b;
  unpack_halves<BITS>(p, a, b);
  q[0] = bytes_to_floats(a);
  q[1] = bytes_to_floats(b);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int LANES = 8;
using Vec = __m256;
inline Vec vzero() {
  return _mm256_setzero_ps();
}
inline Vec vset1(float v) {
  return _mm256_set1_ps(v);
}
inline Vec vload(const float* p) {
  return _mm256_loadu_ps(p);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return _mm256_fmadd_ps(a, b, c);
}
inline Vec vmul(Vec a, Vec b) {
  return _mm256_mul_ps(a, b);
}
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec bytes_to_floats(__m128i b) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
template <int BITS>
inline void unpack(const uint8_t* p, Vec q[32 / LANES]) {
  __m128i a, b;
  unpack_halves<BITS>(p, a, b);
  q[0] = bytes_to_floats(a);
  q[1] = bytes_to_floats(_mm_srli_si128(a, 8));
  q[2] = bytes_to_floats(b);
  q[3] = bytes_to_floats(_mm_srli_si128(b, 8));
}
#else
constexpr int LANES = 1;
using Vec = float;
inline Vec vzero() {
  return 0.0f;
}
inline Vec vset1(float v) {
  return v;
}
inline Vec vload(const float* p) {
  return *p;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return a * b + c;
}
inline Vec vmul(Vec a, Vec b) {
  return a * b;
}
inline float vsum(Vec v) {
  return v;
}
template <int BITS>
inline void unpack(const uint8_t* p, Vec q[32]) {
  uint8_t bytes[32];
  unpack_bytes<BITS>(p, bytes);
  for (int i = 0; i < 32; ++i) q[i] = static_cast<float>(bytes[i]);
}
#endif

constexpr int VPC = 32 / LANES;  // vectors per 32-value chunk

// ---------------------------------------------------------------------------
// The kernel: a tile of MT activation rows x NT weight rows at a time. Each group's
// q values are unpacked once per tile, scaled by the group's scale (one multiply
// per weight row), then multiplied into every activation row of the tile.
// ---------------------------------------------------------------------------

struct IntX;

struct Problem {
  const float* x;  // (M, K)
  const float* xsum;  // (M, G): sums of x over each group
  const uint8_t* w;  // (N, K * bits / 8)
  const void* scales;  // (N, G)
  const void* biases;  // (N, G)
  float* out;  // (M, N)
  int M, N, K, G, group_size;
  const IntX* qx;  // x quantized for the integer path, or null
};

template <int BITS, typename S, int MT, int NT>
void tile(const Problem& p, int m0, int n0) {
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const S* scales = static_cast<const S*>(p.scales);
  const S* biases = static_cast<const S*>(p.biases);
  Vec acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = vzero();
  const int chunks = p.group_size / 32;
  for (int g = 0; g < p.G; ++g) {
    Vec scale[NT];
    for (int j = 0; j < NT; ++j) {
      scale[j] = vset1(to_float(scales[static_cast<size_t>(n0 + j) * p.G + g]));
    }
    if constexpr (MT == 1) {
      // One activation row (a decode step): the group's dot product first, then one
      // multiply-add by the scale, instead of scaling every unpacked vector.
      const float* xr = p.x + static_cast<size_t>(m0) * p.K;
      Vec dot[NT];
      for (int j = 0; j < NT; ++j) dot[j] = vzero();
      for (int c = 0; c < chunks; ++c) {
        const int k0 = g * p.group_size + c * 32;
        for (int j = 0; j < NT; ++j) {
          Vec q[VPC];
          unpack<BITS>(p.w + (n0 + j) * row_bytes + k0 * BITS / 8, q);
          for (int v = 0; v < VPC; ++v) dot[j] = vfma(q[v], vload(xr + k0 + v * LANES), dot[j]);
        }
      }
      for (int j = 0; j < NT; ++j) acc[0][j] = vfma(dot[j], scale[j], acc[0][j]);
      continue;
    }
    for (int c = 0; c < chunks; ++c) {
      const int k0 = g * p.group_size + c * 32;
      Vec q[NT][VPC];
      for (int j = 0; j < NT; ++j) {
        unpack<BITS>(p.w + (n0 + j) * row_bytes + k0 * BITS / 8, q[j]);
        for (int v = 0; v < VPC; ++v) q[j][v] = vmul(q[j][v], scale[j]);
      }
      for (int i = 0; i < MT; ++i) {
        const float* xr = p.x + static_cast<size_t>(m0 + i) * p.K + k0;
        for (int v = 0; v < VPC; ++v) {
          const Vec xv = vload(xr + v * LANES);
          for (int j = 0; j < NT; ++j) acc[i][j] = vfma(q[j][v], xv, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i) {
    const float* xs = p.xsum + static_cast<size_t>(m0 + i) * p.G;
    for (int j = 0; j < NT; ++j) {
      const S* b = biases + static_cast<size_t>(n0 + j) * p.G;
      float bias_term = 0.0f;
      for (int g = 0; g < p.G; ++g) bias_term += to_float(b[g]) * xs[g];
      p.out[static_cast<size_t>(m0 + i) * p.N + n0 + j] = vsum(acc[i][j]) + bias_term;
    }
  }
}

// Activation-row tiles for a block of NT weight rows.
template <int BITS, typename S, int NT>
void rows(const Problem& p, int n0) {
  int m = 0;
  for (; m + 4 <= p.M; m += 4) tile<BITS, S, 4, NT>(p, m, n0);
  switch (p.M - m) {
    case 3:
      tile<BITS, S, 3, NT>(p, m, n0);
      break;
    case 2:
      tile<BITS, S, 2, NT>(p, m, n0);
      break;
    case 1:
      tile<BITS, S, 1, NT>(p, m, n0);
      break;
    default:
      break;
  }
}

constexpr int NT_MAX = 4;

// Many activation rows (a prefill): NT weight rows are dequantized once into a float
// buffer that stays in cache, then every activation row streams past it, so the
// unpacking is paid once per weight rather than once per four activation rows.
constexpr int WIDE_M = 8;

template <int BITS, typename S>
void dequantize_row(const Problem& p, int n, float* out) {
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const S* scales = static_cast<const S*>(p.scales) + static_cast<size_t>(n) * p.G;
  const S* biases = static_cast<const S*>(p.biases) + static_cast<size_t>(n) * p.G;
  for (int g = 0; g < p.G; ++g) {
    const Vec scale = vset1(to_float(scales[g]));
    const Vec bias = vset1(to_float(biases[g]));
    for (int c = 0; c < p.group_size / 32; ++c) {
      const int k0 = g * p.group_size + c * 32;
      Vec q[VPC];
      unpack<BITS>(p.w + n * row_bytes + k0 * BITS / 8, q);
      for (int v = 0; v < VPC; ++v) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        _mm512_storeu_ps(out + k0 + v * LANES, vfma(q[v], scale, bias));
#elif defined(__AVX2__) && defined(__FMA__)
        _mm256_storeu_ps(out + k0 + v * LANES, vfma(q[v], scale, bias));
#else
        out[k0 + v] = vfma(q[v], scale, bias);
#endif
      }
    }
  }
}

template <int MT, int NT>
void dense_tile(const Problem& p, const float* w, int m0, int n0) {
  Vec acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = vzero();
  for (int k = 0; k < p.K; k += LANES) {
    Vec wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = vload(w + static_cast<size_t>(j) * p.K + k);
    for (int i = 0; i < MT; ++i) {
      const Vec xv = vload(p.x + static_cast<size_t>(m0 + i) * p.K + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = vfma(wv[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) p.out[static_cast<size_t>(m0 + i) * p.N + n0 + j] = vsum(acc[i][j]);
}

template <int BITS, typename S, int NT>
void wide_rows(const Problem& p, int n0, std::vector<float>& buffer) {
  buffer.resize(static_cast<size_t>(NT) * p.K);
  for (int j = 0; j < NT; ++j) dequantize_row<BITS, S>(p, n0 + j, buffer.data() + j * p.K);
  int m = 0;
  for (; m + 4 <= p.M; m += 4) dense_tile<4, NT>(p, buffer.data(), m, n0);
  for (; m < p.M; ++m) dense_tile<1, NT>(p, buffer.data(), m, n0);
}

// ---------------------------------------------------------------------------
// Few activation rows (decode steps, batched decode, speculative verification):
// integer dot products, no float unpacking of the weights. Each activation value is
// split into two int16 parts, x = scale * (coarse + fine / 65534), with one scale per
// run of 4 values (the largest magnitude of the run maps to 32767): as precise as
// float32 (one int16 part alone moved SmolLM2's logits by 1.6e-3). The weights'
// unsigned integers, widened to 16 bits, are multiplied into both parts with vpdpwssd
// (AVX512-VNNI; vpmaddwd + add without it): 32 exact multiply-adds per instruction.
// Per 64 weights of a row (a block) each part leaves one int32 vector whose lane j sums
// values 4j .. 4j + 3 (lanes 0-7 the first 32 values, 8-15 the next 32): converted to
// float once, combined, and multiplied per lane by weight scale x activation scale.
// The bias term sum_g bias[n, g] * xsum[m, g] goes 16 groups per FMA into the same
// accumulator, and each output is reduced across lanes once.
//
// The activation is stored in the order the weights unpack in: per block, the 32
// values at even positions (the weights' low nibbles or low bytes, as words), then the
// 32 at odd positions. A NaN or infinity in x sends the call to the float path.
// ---------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PIPESERVE_INT_PATH 1

// Activation rows up to which the integer path runs: measured faster than the float
// tiles up to 4 rows, slower than the wide path at 8.
constexpr int INT_MAX_M = 4;
constexpr float INT16_LIMIT = 32767.0f;
constexpr float FINE_STEPS = 65534.0f;  // the fine part's steps per coarse step

struct QuantizedX {
  // (M, blocks, 128): per block the coarse part's 32 even- and 32 odd-position values,
  // then the fine part's
  std::vector<int16_t> q;
  std::vector<float> scale;  // (M, blocks, 16): per int32 lane, its 4 values' scale
  std::vector<float> xsum;  // (M, padded_groups): sums of x over each group, 0 past G
  int blocks = 0;
  int padded_groups = 0;
};

// Each value's magnitude bound: the largest magnitude of its run of 4 (the values one
// int32 lane of the dot products covers, so a lane can carry its own scale).
inline __m512 max_of_fours(__m512 v) {
  v = _mm512_abs_ps(v);
  v = _mm512_max_ps(v, _mm512_permute_ps(v, 0xb1));  // neighbours swapped
  return _mm512_max_ps(v, _mm512_permute_ps(v, 0x4e));  // pairs swapped
}

// 16 values v = scale * (coarse + fine / FINE_STEPS), both int16 (as int32): coarse on
// the int16 scale of the value's run of 4, fine its rounding remainder, together as
// precise as float32 itself.
inline void quantize16(__m512 v, __m512& scale, __m512i& coarse, __m512i& fine) {
  const __m512 bound = max_of_fours(v);
  const __mmask16 nonzero = _mm512_cmp_ps_mask(bound, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(INT16_LIMIT), bound);
  scale = _mm512_mul_ps(bound, _mm512_set1_ps(1.0f / INT16_LIMIT));
  const __m512 scaled = _mm512_mul_ps(v, inv);
  coarse = _mm512_cvtps_epi32(scaled);
  const __m512 rest = _mm512_sub_ps(scaled, _mm512_cvtepi32_ps(coarse));  // within +-0.5
  fine = _mm512_cvtps_epi32(_mm512_mul_ps(rest, _mm512_set1_ps(FINE_STEPS)));
}

// The 16 values of `coarse` and `fine` (int32) as int16 in the kernel's order: `at` the
// first 16 of a block's 32 even-position slots, `at + 32` the odd ones.
inline void store_parted(__m512i a, __m512i b, __m512i split_idx, int16_t* at) {
  const __m256i qa = _mm512_cvtepi32_epi16(a);
  const __m256i qb = _mm512_cvtepi32_epi16(b);
  const __m512i natural = _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
  const __m512i parted = _mm512_permutexvar_epi16(split_idx, natural);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_castsi512_si256(parted));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 32), _mm512_extracti64x4_epi64(parted, 1));
}

// Quantizes x into qx; false when x holds a NaN or an infinity.
bool quantize_x(const float* x, int M, int K, int group_size, QuantizedX& qx) {
  const int G = K / group_size;
  qx.blocks = (K + 63) / 64;
  qx.padded_groups = (G + 15) / 16 * 16;
  qx.q.assign(static_cast<size_t>(M) * qx.blocks * 128, 0);
  qx.scale.assign(static_cast<size_t>(M) * qx.blocks * 16, 0.0f);
  qx.xsum.assign(static_cast<size_t>(M) * qx.padded_groups, 0.0f);
  // 32 consecutive int16 -> the 16 at even positions, then the 16 at odd positions
  alignas(64) int16_t split[32];
  for (int i = 0; i < 16; ++i) {
    split[i] = static_cast<int16_t>(2 * i);
    split[16 + i] = static_cast<int16_t>(2 * i + 1);
  }
  const __m512i split_idx = _mm512_load_si512(split);
  // the first value of each run of 4 in two vectors: one scale per int32 lane
  const __m512i run_idx = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  __mmask16 bad = 0;
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < K / 32; ++c) {
      const float* v = x + static_cast<size_t>(m) * K + c * 32;
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_sub_ps(b, b), _CMP_UNORD_Q);
      __m512 scale_a, scale_b;
      __m512i coarse_a, coarse_b, fine_a, fine_b;
      quantize16(a, scale_a, coarse_a, fine_a);
      quantize16(b, scale_b, coarse_b, fine_b);
      // The bias term uses the quantized values too, so that the product is exactly that
      // of the quantized x: with x's own sums the error of sum q * x (q >= 0, off-centre)
      // would not cancel against the bias term's.
      const __m512 fine_unit = _mm512_set1_ps(1.0f / FINE_STEPS);
      const __m512 da = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine_a), fine_unit,
                                        _mm512_cvtepi32_ps(coarse_a));
      const __m512 db = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine_b), fine_unit,
                                        _mm512_cvtepi32_ps(coarse_b));
      qx.xsum[static_cast<size_t>(m) * qx.padded_groups + c * 32 / group_size] +=
          _mm512_reduce_add_ps(_mm512_fmadd_ps(da, scale_a, _mm512_mul_ps(db, scale_b)));
      const size_t block = static_cast<size_t>(m) * qx.blocks + c / 2;
      const int half = c % 2;
      int16_t* out = qx.q.data() + block * 128 + half * 16;
      store_parted(coarse_a, coarse_b, split_idx, out);
      store_parted(fine_a, fine_b, split_idx, out + 64);
      const __m512 lane_scales = _mm512_permutex2var_ps(scale_a, run_idx, scale_b);
      _mm256_storeu_ps(qx.scale.data() + block * 16 + half * 8, _mm512_castps512_ps256(lane_scales));
    }
  }
  return bad == 0;
}

struct IntX {
  const int16_t* q;
  const float* scale;
  const float* xsum;
  int blocks;
  int padded_groups;
};

inline __m512i dot_words(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// 64 five-bit values (40 bytes; 20 and 32 values when HALF) as 64 bytes: 5 bytes hold
// 8 values, which pdep spreads into one byte each; whole 8-byte loads within the block,
// the last one shifted down.
template <bool HALF>
inline __m512i five_bit_bytes(const uint8_t* p) {
  constexpr int parts = HALF ? 4 : 8;
  alignas(64) uint64_t u[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < parts; ++k) u[k] = five_bit_word(p, k, k == parts - 1);
  return _mm512_load_si512(u);
}

// The 64 quantized values of a block as words: `lo` values 0, 2, .., 62, `hi` values
// 1, 3, .., 63. HALF: only the first 32 exist (a row whose K is an odd multiple of 32).
template <int BITS, bool HALF>
inline void unpack_words(const uint8_t* p, __m512i& lo, __m512i& hi) {
  if constexpr (BITS == 4) {
    const __m256i bytes = HALF ? _mm256_maskz_loadu_epi8(0xffff, p)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i words = _mm512_cvtepu8_epi16(bytes);
    lo = _mm512_and_si512(words, _mm512_set1_epi16(0x0f));
    hi = _mm512_srli_epi16(words, 4);
  } else {
    __m512i bytes;
    if constexpr (BITS == 8) {
      bytes = HALF ? _mm512_maskz_loadu_epi8(0xffffffffULL, p) : _mm512_loadu_si512(p);
    } else {
      bytes = five_bit_bytes<HALF>(p);
    }
    lo = _mm512_and_si512(bytes, _mm512_set1_epi16(0xff));
    hi = _mm512_srli_epi16(bytes, 8);
  }
}

// Two scales as floats in lanes 0 and 1.
inline __m128 scale_pair(const uint16_t* p) {
  uint32_t two;
  std::memcpy(&two, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
}
inline __m128 scale_pair(const float* p) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}

// A row's scales for block b: lanes 0-7 the first 32 values' group, 8-15 the next's.
template <typename S, bool HALF>
inline __m512 block_scales(const S* row, int b, int group_size) {
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m128 pair;
  if (group_size == 32 && !HALF) {
    pair = scale_pair(row + 2 * b);
  } else {
    const int first = 64 * b / group_size;
    const int second = HALF ? first : (64 * b + 32) / group_size;
    pair = _mm_setr_ps(to_float(row[first]), to_float(row[second]), 0.0f, 0.0f);
  }
  return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(pair));
}

template <typename S>
inline __m512 load16(const S* p, __mmask16 mask) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

// Weight rows ahead of the ones in use that each block prefetches (the same offset in a
// later row): the hardware prefetcher alone left a decode step at a third of the
// memory bandwidth.
constexpr int PREFETCH_ROWS = 8;

template <int BITS, typename S, bool HALF, int MT, int NT>
__attribute__((always_inline)) inline void int_block(
    const Problem& p, const IntX& qx, int m0, int n0, int b, __m512 (&acc)[MT][NT]) {
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const S* scales = static_cast<const S*>(p.scales);
  __m512i lo[NT], hi[NT];
  __m512 ws[NT];
  for (int j = 0; j < NT; ++j) {
    const uint8_t* wp = p.w + (n0 + j) * row_bytes + static_cast<size_t>(b) * 8 * BITS;
    if (BITS != 4 || b % 2 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
    }
    unpack_words<BITS, HALF>(wp, lo[j], hi[j]);
    ws[j] = block_scales<S, HALF>(scales + static_cast<size_t>(n0 + j) * p.G, b, p.group_size);
  }
  for (int i = 0; i < MT; ++i) {
    const size_t xb = static_cast<size_t>(m0 + i) * qx.blocks + b;
    const int16_t* xq = qx.q + xb * 128;
    const __m512i even = _mm512_loadu_si512(xq), odd = _mm512_loadu_si512(xq + 32);
    const __m512i fine_even = _mm512_loadu_si512(xq + 64);
    const __m512i fine_odd = _mm512_loadu_si512(xq + 96);
    const __m512 xs = _mm512_loadu_ps(qx.scale + xb * 16);
    const __m512 fine_unit = _mm512_set1_ps(1.0f / FINE_STEPS);
    for (int j = 0; j < NT; ++j) {
      const __m512i coarse = dot_words(_mm512_madd_epi16(lo[j], even), hi[j], odd);
      const __m512i fine = dot_words(_mm512_madd_epi16(lo[j], fine_even), hi[j], fine_odd);
      const __m512 dot = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(fine), fine_unit, _mm512_cvtepi32_ps(coarse));
      acc[i][j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws[j], xs), acc[i][j]);
    }
  }
}

template <int BITS, typename S, int MT, int NT>
void int_tile(const Problem& p, const IntX& qx, int m0, int n0) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const size_t scale_bytes = static_cast<size_t>(p.G) * sizeof(S);
  for (int j = 0; j < NT; ++j) {
    const size_t ahead = (static_cast<size_t>(n0) + j + PREFETCH_ROWS) * scale_bytes;
    for (size_t at = 0; at < scale_bytes; at += 64) {
      _mm_prefetch(static_cast<const char*>(p.scales) + ahead + at, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(p.biases) + ahead + at, _MM_HINT_T0);
    }
  }
  const int full = p.K / 64;
  for (int b = 0; b < full; ++b) int_block<BITS, S, false, MT, NT>(p, qx, m0, n0, b, acc);
  if (p.K % 64 != 0) int_block<BITS, S, true, MT, NT>(p, qx, m0, n0, full, acc);
  const S* biases = static_cast<const S*>(p.biases);
  for (int g = 0; g < p.G; g += 16) {
    const __mmask16 mask = p.G - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (p.G - g)) - 1);
    for (int j = 0; j < NT; ++j) {
      const __m512 bias = load16(biases + static_cast<size_t>(n0 + j) * p.G + g, mask);
      for (int i = 0; i < MT; ++i) {
        const float* xs = qx.xsum + static_cast<size_t>(m0 + i) * qx.padded_groups + g;
        acc[i][j] = _mm512_fmadd_ps(bias, _mm512_loadu_ps(xs), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j)
      p.out[static_cast<size_t>(m0 + i) * p.N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int BITS, typename S, int NT>
void int_rows(const Problem& p, const IntX& qx, int n0) {
  int m = 0;
  for (; m + 4 <= p.M; m += 4) int_tile<BITS, S, 4, NT>(p, qx, m, n0);
  switch (p.M - m) {
    case 3:
      int_tile<BITS, S, 3, NT>(p, qx, m, n0);
      break;
    case 2:
      int_tile<BITS, S, 2, NT>(p, qx, m, n0);
      break;
    case 1:
      int_tile<BITS, S, 1, NT>(p, qx, m, n0);
      break;
    default:
      break;
  }
}
#endif

template <int BITS, typename S>
void row_range(const Problem& p, int n_begin, int n_end) {
  int n = n_begin;
#if defined(PIPESERVE_INT_PATH)
  if (p.qx != nullptr) {
    for (; n + NT_MAX <= n_end; n += NT_MAX) int_rows<BITS, S, NT_MAX>(p, *p.qx, n);
    for (; n < n_end; ++n) int_rows<BITS, S, 1>(p, *p.qx, n);
    return;
  }
#endif
  if (p.M >= WIDE_M && p.K % LANES == 0) {
    thread_local std::vector<float> buffer;
    for (; n + NT_MAX <= n_end; n += NT_MAX) wide_rows<BITS, S, NT_MAX>(p, n, buffer);
    for (; n < n_end; ++n) wide_rows<BITS, S, 1>(p, n, buffer);
    return;
  }
  for (; n + NT_MAX <= n_end; n += NT_MAX) rows<BITS, S, NT_MAX>(p, n);
  for (; n < n_end; ++n) rows<BITS, S, 1>(p, n);
}

constexpr size_t CHUNK_WEIGHTS = 1 << 16;  // work per claimed chunk (weights x rows of x)

template <int BITS, typename S>
void run(const Problem& p) {
  // Chunks of whole NT_MAX-row blocks, each about CHUNK_WEIGHTS multiply-adds.
  const int blocks = (p.N + NT_MAX - 1) / NT_MAX;
  const size_t block_work = static_cast<size_t>(NT_MAX) * p.K * p.M;
  const int per_chunk = static_cast<int>(std::max<size_t>(1, CHUNK_WEIGHTS / block_work));
  const int chunks = (blocks + per_chunk - 1) / per_chunk;
  pool()->run(chunks, [&](int chunk) {
    const int n0 = std::min(p.N, chunk * per_chunk * NT_MAX);
    const int n1 = std::min(p.N, (chunk + 1) * per_chunk * NT_MAX);
    row_range<BITS, S>(p, n0, n1);
  });
}

void group_sums(const float* x, float* xsum, int M, int K, int group_size) {
  const int G = K / group_size;
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < G; ++g) {
      const float* xr = x + static_cast<size_t>(m) * K + g * group_size;
      float s = 0.0f;
      for (int k = 0; k < group_size; ++k) s += xr[k];
      xsum[m * G + g] = s;
    }
  }
}

template <typename S>
void dispatch_bits(const Problem& p, int bits) {
  switch (bits) {
    case 4:
      return run<4, S>(p);
    case 5:
      return run<5, S>(p);
    case 8:
      return run<8, S>(p);
    default:
      throw std::invalid_argument("affine_qmm: bits must be 4, 5 or 8");
  }
}

void compute(Problem p, int bits, bool half_scales) {
  std::vector<float> xsum;
#if defined(PIPESERVE_INT_PATH)
  thread_local QuantizedX quantized;
  IntX view{};
  if (p.M <= INT_MAX_M && quantize_x(p.x, p.M, p.K, p.group_size, quantized)) {
    view = {quantized.q.data(), quantized.scale.data(), quantized.xsum.data(), quantized.blocks,
            quantized.padded_groups};
    p.qx = &view;
  }
#endif
  if (p.qx == nullptr) {
    xsum.resize(static_cast<size_t>(p.M) * p.G);
    group_sums(p.x, xsum.data(), p.M, p.K, p.group_size);
    p.xsum = xsum.data();
  }
  if (half_scales) {
    dispatch_bits<uint16_t>(p, bits);
  } else {
    dispatch_bits<float>(p, bits);
  }
}

void affine_qmm_rows(const QmmRows& a) {
  Problem p{};
  p.x = a.x;
  p.w = static_cast<const uint8_t*>(a.w);
  p.scales = a.scales;
  p.biases = a.biases;
  p.out = a.out;
  p.M = a.M;
  p.K = a.K;
  p.N = a.N;
  p.G = a.K / a.group_size;
  p.group_size = a.group_size;
  compute(p, a.bits, a.half_scales);
}

// ---------------------------------------------------------------------------
// The MLX primitive and op.
// ---------------------------------------------------------------------------

class AffineQmm : public mx::Primitive {
 public:
  AffineQmm(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& scales = inputs[2];
    const auto& biases = inputs[3];
    auto& out = outputs[0];
    for (const auto* a : {&x, &w, &scales, &biases}) {
      if (!a->flags().row_contiguous) {
        throw std::runtime_error("affine_qmm: inputs must be row-contiguous");
      }
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_input_array(scales);
    encoder.set_input_array(biases);
    encoder.set_output_array(out);
    Problem p{};
    p.x = x.data<float>();
    p.w = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
    p.scales = scales.data<void>();
    p.biases = biases.data<void>();
    p.out = out.data<float>();
    p.M = x.shape(0);
    p.K = x.shape(1);
    p.N = w.shape(0);
    p.G = p.K / group_size_;
    p.group_size = group_size_;
    const bool half = scales.dtype() == mx::float16;
    encoder.dispatch([p, bits = bits_, half]() { compute(p, bits, half); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("affine_qmm runs on the CPU only");
  }

  const char* name() const override {
    return "PipeserveAffineQmm";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AffineQmm&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(0)}};
  }

 private:
  int group_size_;
  int bits_;
};

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("affine_qmm: " + message);
}

mx::array affine_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "runs on the CPU only");
  check(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  check(group_size % 32 == 0 && group_size > 0, "group_size must be a multiple of 32");
  check(w.ndim() == 2 && w.dtype() == mx::uint32, "w must be a 2-D uint32 array");
  check(x.ndim() >= 1, "x must have at least one dimension");
  const int K = x.shape(-1);
  const int N = w.shape(0);
  check(static_cast<int64_t>(w.shape(1)) * 32 == static_cast<int64_t>(K) * bits,
        "w's packed width does not match x's last dimension");
  check(K % group_size == 0, "x's last dimension must be a multiple of group_size");
  check(scales.shape() == mx::Shape({N, K / group_size}), "scales must be (N, K / group_size)");
  check(biases.shape() == scales.shape(), "biases must have the scales' shape");
  check(scales.dtype() == biases.dtype() &&
            (scales.dtype() == mx::float16 || scales.dtype() == mx::float32),
        "scales and biases must both be float16 or both float32");
  auto flat = mx::reshape(mx::astype(x, mx::float32, stream), {-1, K}, stream);
  flat = mx::contiguous(flat, false, stream);
  const int M = flat.shape(0);
  auto out = mx::array(
      {M, N},
      mx::float32,
      std::make_shared<AffineQmm>(stream, group_size, bits),
      {flat, w, scales, biases});
  auto shape = x.shape();
  shape.back() = N;
  return mx::reshape(out, shape, stream);
}

int threads() {
  return pool()->threads();
}

std::string simd_name() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace pipeserve

