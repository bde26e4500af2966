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
// rounded to int16 per run of 8 values, bit-identical per row at every M (see
// "Decode steps, batched decode, speculative verification").
//
// SIMD: AVX-512 (16 lanes) or AVX2/FMA (8 lanes), picked by the compiler flags the
// build chose from this CPU's features (the build cache is keyed by them), with a
// scalar form for anything else. Output rows are split across a small thread pool.

#include <immintrin.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
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
#include "simd512.h"

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
  const void* biases;  // (N, G), or null: symmetric, each bias `zero` x its scale
  float* out;  // (M, N)
  int M, N, K, G, group_size;
  const IntX* qx;  // x quantized for the integer path, or null
  float zero;  // -2^(bits - 1): a symmetric format's (Q8_0's, Q4_0's) bias per unit of scale
};

// Group g's bias of weight row n.
template <typename S>
inline float bias_at(const Problem& p, size_t n, int g) {
  const size_t at = n * p.G + g;
  return p.biases ? to_float(static_cast<const S*>(p.biases)[at])
                  : p.zero * to_float(static_cast<const S*>(p.scales)[at]);
}

template <int BITS, typename S, int MT, int NT>
void tile(const Problem& p, int m0, int n0) {
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const S* scales = static_cast<const S*>(p.scales);
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
      float bias_term = 0.0f;
      for (int g = 0; g < p.G; ++g) bias_term += bias_at<S>(p, n0 + j, g) * xs[g];
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
  for (int g = 0; g < p.G; ++g) {
    const Vec scale = vset1(to_float(scales[g]));
    const Vec bias = vset1(bias_at<S>(p, n, g));
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
// Decode steps, batched decode, speculative verification (up to INT_MAX_M rows of x):
// integer dot products, no float unpacking of the weights. Each activation value is
// rounded to one int16, x = scale * q, one scale per 8 values (the values one int32
// lane of the dot products covers; the largest magnitude maps to 32767). The weights'
// unsigned integers, widened to 16 bits, are multiplied into it with vpdpwssd
// (AVX512-VNNI; vpmaddwd + add without it): 32 exact multiply-adds per instruction.
//
// A superblock is 128 values of a row (4 chunks of 32). Its weights are arranged into
// four word vectors so that int32 lane l sums 8 values of one chunk (lanes 4c .. 4c + 3
// chunk c): four multiply-add instructions, then one conversion to float and one FMA by
// weight scale x activation scale per lane. The bias term sum_g bias[n, g] * xsum[m, g]
// goes 16 groups per FMA into the same accumulator; each output is reduced once.
//
// Every row of x is quantized on its own and every output's float operations come in
// the same order whatever M is and however rows are tiled, so a row's result is
// bit-identical at every M up to INT_MAX_M (speculative verification at M = W + 1 gives
// exactly the numbers a decode step at M = 1 gives). A NaN or infinity in x sends the
// call to the float path.
// ---------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PIPESERVE_INT_PATH 1

// Activation rows up to which the integer path runs (above: the float wide path, for
// prefills); measured faster than the float paths at every M up to here.
constexpr int INT_MAX_M = 64;
constexpr float INT16_LIMIT = 32767.0f;
constexpr int SUPER = 128;  // values per superblock
constexpr int SUPER_WORDS = 128;  // int16 of x per superblock: 4 vectors of 32

struct QuantizedX {
  // (M, blocks, 128): per superblock the four word vectors the weights pair with
  std::vector<int16_t> q;
  std::vector<float> scale;  // (M, blocks, 16): per int32 lane, its 8 values' scale
  std::vector<float> xsum;  // (M, padded_groups): sums of the quantized x per group, 0 past G
  int blocks = 0;
  int padded_groups = 0;
};

struct IntX {
  const int16_t* q;
  const float* scale;
  const float* xsum;
  int blocks;
  int padded_groups;
};

// Each lane: the largest magnitude of its run of 4.
inline __m512 max_of_fours(__m512 v) {
  v = _mm512_abs_ps(v);
  v = _mm512_max_ps(v, _mm512_permute_ps(v, 0xb1));  // neighbours swapped
  return _mm512_max_ps(v, _mm512_permute_ps(v, 0x4e));  // pairs swapped
}

// 16 int32 as int16: the 8 at even positions to `even`, the 8 at odd ones to `odd`.
inline void store_split(__m512i q, int16_t* even, int16_t* odd) {
  const __m256i split = _mm256_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i parted = _mm256_permutexvar_epi16(split, _mm512_cvtepi32_epi16(q));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(even), _mm256_castsi256_si128(parted));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(odd), _mm256_extracti128_si256(parted, 1));
}

// Chunk c of a superblock: values 0-15 (a) go to the word vectors 0 (even positions)
// and 1 (odd), 16-31 (b) to 2 and 3, each at words 8c .. 8c + 7; int32 lane 4c + s
// then covers values 4s .. 4s + 3 and 16 + 4s .. 16 + 4s + 3, which share a scale.
inline float quantize_chunk(__m512 a, __m512 b, int16_t* words, float* lane_scales, int c) {
  const __m512 bound = _mm512_max_ps(max_of_fours(a), max_of_fours(b));
  const __mmask16 nonzero = _mm512_cmp_ps_mask(bound, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(INT16_LIMIT), bound);
  const __m512 scale = _mm512_mul_ps(bound, _mm512_set1_ps(1.0f / INT16_LIMIT));
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  store_split(qa, words + 8 * c, words + 32 + 8 * c);
  store_split(qb, words + 64 + 8 * c, words + 96 + 8 * c);
  const __m512i run_starts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(lane_scales + 4 * c,
                _mm512_castps512_ps128(_mm512_permutexvar_ps(run_starts, scale)));
  // The bias term uses the quantized values too, so that the product is exactly that of
  // the quantized x: with x's own sums the error of sum q * x (q >= 0, off-centre) would
  // not cancel against the bias term's.
  const __m512 both = _mm512_add_ps(_mm512_cvtepi32_ps(qa), _mm512_cvtepi32_ps(qb));
  return _mm512_reduce_add_ps(_mm512_mul_ps(both, scale));
}

// Quantizes x into qx; false when x holds a NaN or an infinity.
bool quantize_x(const float* x, int M, int K, int group_size, QuantizedX& qx) {
  const int G = K / group_size;
  qx.blocks = (K + SUPER - 1) / SUPER;
  qx.padded_groups = (G + 15) / 16 * 16;
  qx.q.assign(static_cast<size_t>(M) * qx.blocks * SUPER_WORDS, 0);
  qx.scale.assign(static_cast<size_t>(M) * qx.blocks * 16, 0.0f);
  qx.xsum.assign(static_cast<size_t>(M) * qx.padded_groups, 0.0f);
  __mmask16 bad = 0;
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < K / 32; ++c) {
      const float* v = x + static_cast<size_t>(m) * K + c * 32;
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_sub_ps(b, b), _CMP_UNORD_Q);
      const size_t block = static_cast<size_t>(m) * qx.blocks + c / 4;
      qx.xsum[static_cast<size_t>(m) * qx.padded_groups + c * 32 / group_size] += quantize_chunk(
          a, b, qx.q.data() + block * SUPER_WORDS, qx.scale.data() + block * 16, c % 4);
    }
  }
  return bad == 0;
}

inline __m512i dot_words(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// 8-bit-like bytes of a superblock (z0: chunks 0-1, z1: chunks 2-3, one byte a value)
// as the four word vectors: vector 0 the even and 1 the odd values of each chunk's
// first 16, 2 and 3 those of its last 16.
inline void byte_words(__m512i z0, __m512i z1, __m512i (&w)[4]) {
  const __m512i first = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512i last = _mm512_shuffle_i64x2(z0, z1, _MM_SHUFFLE(3, 1, 3, 1));
  const __m512i low = _mm512_set1_epi16(0xff);
  w[0] = _mm512_and_si512(first, low);
  w[1] = _mm512_srli_epi16(first, 8);
  w[2] = _mm512_and_si512(last, low);
  w[3] = _mm512_srli_epi16(last, 8);
}

inline __mmask64 byte_mask(int bytes) {
  return bytes >= 64 ? ~0ULL : (1ULL << bytes) - 1;
}

#if defined(__AVX512VBMI__)
// Byte 8i + j: byte 5i + min(j, 4) of 40 (run i's five bytes in qword lane i).
constexpr auto five_bit_runs() {
  std::array<uint8_t, 64> runs{};
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) runs[8 * i + j] = static_cast<uint8_t>(5 * i + std::min(j, 4));
  return runs;
}
alignas(64) constexpr std::array<uint8_t, 64> FIVE_BIT_RUNS = five_bit_runs();
#endif

// A superblock's quantized values (its first `chunks` chunks exist) as word vectors.
template <int BITS>
inline void unpack_super(const uint8_t* p, int chunks, __m512i (&w)[4]) {
  if constexpr (BITS == 4) {
    // 16 bytes a chunk, byte j: values 2j (low nibble), 2j + 1; qwords reordered so the
    // first 32 bytes hold each chunk's first 8 bytes (its values 0-15)
    __m512i z = chunks == 4 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(byte_mask(16 * chunks), p);
    z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), z);
    const __m512i first = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(z));
    const __m512i last = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(z, 1));
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    w[0] = _mm512_and_si512(first, nibble);
    w[1] = _mm512_srli_epi16(first, 4);
    w[2] = _mm512_and_si512(last, nibble);
    w[3] = _mm512_srli_epi16(last, 4);
  } else if constexpr (BITS == 8) {
    // Whole superblocks with plain loads (masked byte loads only for a row's last one).
    if (chunks == 4) {
      byte_words(_mm512_loadu_si512(p), _mm512_loadu_si512(p + 64), w);
      return;
    }
    const __m512i z0 = _mm512_maskz_loadu_epi8(byte_mask(32 * chunks), p);
    const __m512i z1 = chunks > 2 ? _mm512_maskz_loadu_epi8(byte_mask(32 * chunks - 64), p + 64)
                                  : _mm512_setzero_si512();
    byte_words(z0, z1, w);
  } else {
#if defined(__AVX512VBMI__)
    if (chunks == 4) {
      // 80 bytes, 16 runs of 5 bytes = 8 values each: each run spread into a qword lane
      // (vpermb), its eight 5-bit fields picked into bytes (vpmultishiftqb), masked. No
      // round trip through memory (the word-by-word form below stalls on store forwarding).
      const __m512i runs = _mm512_load_si512(FIVE_BIT_RUNS.data());
      const __m512i fields = _mm512_set1_epi64(0x231e19140f0a0500LL);  // bit offsets 0, 5, .., 35
      const __m512i five = _mm512_set1_epi8(0x1f);
      // the second half's 40 bytes (40..79) are bytes 24..63 of the load at p + 16
      const __m512i second = _mm512_add_epi8(runs, _mm512_set1_epi8(24));
      const __m512i a = _mm512_permutexvar_epi8(runs, _mm512_loadu_si512(p));
      const __m512i b = _mm512_permutexvar_epi8(second, _mm512_loadu_si512(p + 16));
      byte_words(_mm512_and_si512(_mm512_multishift_epi64_epi8(fields, a), five),
                 _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, b), five), w);
      return;
    }
#endif
    // 5 bytes hold 8 values; pdep spreads them into bytes (the last word of the
    // superblock loaded 3 bytes early and shifted, so no load reads past it)
    alignas(64) uint64_t u[16] = {};
    const int words = 4 * chunks;
    for (int k = 0; k < words; ++k) u[k] = five_bit_word(p, k, k == words - 1);
    byte_words(_mm512_load_si512(u), _mm512_load_si512(u + 8), w);
  }
}

inline __m128 four_scales(const uint16_t* p, __mmask8 present) {
  return _mm_cvtph_ps(_mm_maskz_loadu_epi16(present, p));
}
inline __m128 four_scales(const float* p, __mmask8 present) {
  return _mm_maskz_loadu_ps(present, p);
}

// A row's scales for superblock b: lanes 4c .. 4c + 3 chunk c's group, 0 past the row.
template <typename S>
inline __m512 super_scales(const S* row, int b, int chunks, int group_size) {
  __m128 four;
  if (group_size == 32) {
    four = four_scales(row + 4 * b, static_cast<__mmask8>((1u << chunks) - 1));
  } else {
    alignas(16) float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = 0; c < chunks; ++c) f[c] = to_float(row[(SUPER * b + 32 * c) / group_size]);
    four = _mm_load_ps(f);
  }
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(four));
}

template <typename S>
inline __m512 load16(const S* p, __mmask16 mask) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

// Weight rows ahead of the ones in use that each superblock prefetches (the same
// offset in a later row): the hardware prefetcher alone left a decode step at a third
// of the memory bandwidth.
constexpr int PREFETCH_ROWS = 8;

inline int super_chunks(const Problem& p, int b) {
  return std::min(4, (p.K - SUPER * b) / 32);
}

template <int BITS, typename S, int AHEAD = PREFETCH_ROWS>
__attribute__((always_inline)) inline void unpack_row(
    const Problem& p, int n, int b, __m512i (&words)[4], __m512& scale) {
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const uint8_t* wp = p.w + n * row_bytes + static_cast<size_t>(b) * SUPER * BITS / 8;
  const char* ahead = reinterpret_cast<const char*>(wp + AHEAD * row_bytes);
  _mm_prefetch(ahead, _MM_HINT_T0);
  if constexpr (BITS > 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
  const int chunks = super_chunks(p, b);
  unpack_super<BITS>(wp, chunks, words);
  scale = super_scales(static_cast<const S*>(p.scales) + static_cast<size_t>(n) * p.G, b,
                         chunks, p.group_size);
}

// Superblock b of MT rows of x into the accumulators of NT unpacked weight rows.
template <int MT, int NT>
__attribute__((always_inline)) inline void mac_super(const IntX& qx, int m0, int b,
    const __m512i (&w)[NT][4], const __m512 (&ws)[NT], __m512 (&acc)[MT][NT]) {
  PIPESERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    const size_t xb = static_cast<size_t>(m0 + i) * qx.blocks + b;
    const int16_t* xq = qx.q + xb * SUPER_WORDS;
    const __m512i x0 = _mm512_loadu_si512(xq), x1 = _mm512_loadu_si512(xq + 32);
    const __m512i x2 = _mm512_loadu_si512(xq + 64), x3 = _mm512_loadu_si512(xq + 96);
    const __m512 xs = _mm512_loadu_ps(qx.scale + xb * 16);
    PIPESERVE_UNROLL
    for (int j = 0; j < NT; ++j) {
      __m512i dot = _mm512_madd_epi16(w[j][0], x0);
      dot = dot_words(dot, w[j][1], x1);
      dot = dot_words(dot, w[j][2], x2);
      dot = dot_words(dot, w[j][3], x3);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[j], xs), acc[i][j]);
    }
  }
}

// The bias term into the accumulators, then the outputs.
template <typename S, int MT, int NT>
__attribute__((always_inline)) inline void finish(const Problem& p, const IntX& qx, int m0, int n0, __m512 (&acc)[MT][NT]) {
  const S* biases = static_cast<const S*>(p.biases);
  const S* scales = static_cast<const S*>(p.scales);
  for (int g = 0; g < p.G; g += 16) {
    const __mmask16 mask = p.G - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (p.G - g)) - 1);
    for (int j = 0; j < NT; ++j) {
      const size_t at = static_cast<size_t>(n0 + j) * p.G + g;
      const __m512 bias = biases ? load16(biases + at, mask)
                                 : _mm512_mul_ps(load16(scales + at, mask), _mm512_set1_ps(p.zero));
      for (int i = 0; i < MT; ++i) {
        const float* xs = qx.xsum + static_cast<size_t>(m0 + i) * qx.padded_groups + g;
        acc[i][j] = _mm512_fmadd_ps(bias, _mm512_loadu_ps(xs), acc[i][j]);
      }
    }
  }
  if constexpr (MT >= 2 && ((NT == 2 && MT <= 8) || NT == 4)) {
    // All the tile's outputs at once: 45 shuffles and adds for 16 accumulators instead
    // of 8 per accumulator. reduce_sixteen sums slot 4j + i into lane 4i + j; each
    // output goes to the slot that puts row i's NT outputs side by side at lane NT i + j
    // (4 x 4: slot 4j + i; up to 8 x 2: slot 4 (2 (i % 2) + j) + i / 2).
    __m512 v[16];
    PIPESERVE_UNROLL
    for (int k = 0; k < 16; ++k) v[k] = _mm512_set1_ps(-0.0f);  // x + -0 == x, exactly
    PIPESERVE_UNROLL
    for (int i = 0; i < MT; ++i)
      PIPESERVE_UNROLL
      for (int j = 0; j < NT; ++j) v[NT == 4 ? 4 * j + i : 4 * (2 * (i % 2) + j) + i / 2] = acc[i][j];
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce_sixteen(v));
    for (int i = 0; i < MT; ++i) {
      std::memcpy(p.out + static_cast<size_t>(m0 + i) * p.N + n0, sums + NT * i, NT * sizeof(float));
    }
  } else {
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j)
        p.out[static_cast<size_t>(m0 + i) * p.N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

template <typename S, int NT, int AHEAD = PREFETCH_ROWS>
void prefetch_scales(const Problem& p, int n0) {
  const size_t scale_bytes = static_cast<size_t>(p.G) * sizeof(S);
  for (int j = 0; j < NT; ++j) {
    const size_t ahead = (static_cast<size_t>(n0) + j + AHEAD) * scale_bytes;
    for (size_t at = 0; at < scale_bytes; at += 64) {
      _mm_prefetch(static_cast<const char*>(p.scales) + ahead + at, _MM_HINT_T0);
      if (p.biases) _mm_prefetch(static_cast<const char*>(p.biases) + ahead + at, _MM_HINT_T0);
    }
  }
}

// Up to 3 rows of x (a decode step, a short verification): each superblock is
// unpacked into registers and used at once.
template <int BITS, typename S, int MT, int NT>
void int_direct(const Problem& p, const IntX& qx, int n0) {
  __m512 acc[MT][NT];
  PIPESERVE_UNROLL
  for (int i = 0; i < MT; ++i)
    PIPESERVE_UNROLL
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  prefetch_scales<S, NT>(p, n0);
  for (int b = 0; b < qx.blocks; ++b) {
    __m512i w[NT][4];
    __m512 ws[NT];
    PIPESERVE_UNROLL
    for (int j = 0; j < NT; ++j) unpack_row<BITS, S>(p, n0 + j, b, w[j], ws[j]);
    mac_super<MT, NT>(qx, 0, b, w, ws, acc);
  }
  finish<S, MT, NT>(p, qx, 0, n0, acc);
}

// Several rows of x: NT weight rows unpacked once into a buffer that stays in L1
// (superblock b of row j: words at [b][j], scales at [b][j]), then every tile of up to
// 4 rows of x streams past it.
// A tile of NT weight rows unpacked into a buffer.
struct Unpacked {
  const __m512i* words;  // (blocks, NT, 4)
  const __m512* scales;  // (blocks, NT)
};

template <typename S, int MT, int NT>
void int_tile(const Problem& p, const IntX& qx, Unpacked u, int m0, int n0) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int b = 0; b < qx.blocks; ++b) {
    const auto& w = *reinterpret_cast<const __m512i(*)[NT][4]>(u.words + b * NT * 4);
    const auto& ws = *reinterpret_cast<const __m512(*)[NT]>(u.scales + b * NT);
    mac_super<MT, NT>(qx, m0, b, w, ws, acc);
  }
  finish<S, MT, NT>(p, qx, m0, n0, acc);
}

// A thread's buffer for unpacked weights, 64-byte aligned.
template <typename V>
V* scratch(size_t count) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> memory;
  thread_local size_t capacity = 0;
  if (count > capacity) {
    memory.reset(std::aligned_alloc(64, count * 64));
    if (!memory) throw std::bad_alloc();
    capacity = count;
  }
  return static_cast<V*>(memory.get());
}

// 4 to 16 rows of x (batched decode, speculative verification): a pair of weight rows
// unpacked into registers per superblock and used at once by a tile of up to 8 rows of
// x, the tile's 16 accumulators in registers; above 8 rows two tiles of half the rows,
// each unpacking again (the pair's weights then come from L1). Against the L1 buffer
// below (4 weight rows unpacked, stored, then read back once per tile of 4 rows of x),
// no store and reload of the unpacked words, and the weights are read in row order, the
// next rows prefetched further ahead: at 8 rows the buffer path stalled on the weights'
// loads (a 4 x 4 tile's compute hides less memory latency than 8 rows' does). Every
// output's float operations are those of int_direct's in the same order, so the bits
// are the same as at 1 row (test_a_rows_result_is_the_same_to_the_bit_at_every_batch_size).
constexpr int PAIR_MIN_M = 4;
constexpr int PAIR_MAX_M = 16;
constexpr int PAIR_TILE = 8;  // rows of x in registers at once
constexpr int PAIR_PREFETCH_ROWS = 16;

template <int BITS, typename S, int MT, int NT>
void int_pairs(const Problem& p, const IntX& qx, int m0, int n0) {
  __m512 acc[MT][NT];
  PIPESERVE_UNROLL
  for (int i = 0; i < MT; ++i)
    PIPESERVE_UNROLL
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  prefetch_scales<S, NT, PAIR_PREFETCH_ROWS>(p, n0);
  const size_t q_stride = static_cast<size_t>(qx.blocks) * SUPER_WORDS;
  const size_t s_stride = static_cast<size_t>(qx.blocks) * 16;
  for (int b = 0; b < qx.blocks; ++b) {
    __m512i w[NT][4];
    __m512 ws[NT];
    PIPESERVE_UNROLL
    for (int j = 0; j < NT; ++j) unpack_row<BITS, S, PAIR_PREFETCH_ROWS>(p, n0 + j, b, w[j], ws[j]);
    mac_super<MT, NT>(qx, m0, b, w, ws, acc);
  }
  finish<S, MT, NT>(p, qx, m0, n0, acc);
}

template <int BITS, typename S, int NT>
void pair_tiles(const Problem& p, const IntX& qx, int n0) {
  // rows of x in one or two tiles of at most PAIR_TILE, the first the larger
  const int first = p.M <= PAIR_TILE ? p.M : (p.M + 1) / 2;
  const auto tile = [&](int rows, int m0) {
    switch (rows) {
      case 4:
        return int_pairs<BITS, S, 4, NT>(p, qx, m0, n0);
      case 5:
        return int_pairs<BITS, S, 5, NT>(p, qx, m0, n0);
      case 6:
        return int_pairs<BITS, S, 6, NT>(p, qx, m0, n0);
      case 7:
        return int_pairs<BITS, S, 7, NT>(p, qx, m0, n0);
      case 8:
        return int_pairs<BITS, S, 8, NT>(p, qx, m0, n0);
      default:
        return;
    }
  };
  tile(first, 0);
  if (first < p.M) tile(p.M - first, first);
}

template <int BITS, typename S, int NT>
void int_rows(const Problem& p, const IntX& qx, int n0) {
  switch (p.M) {
    case 1:
      return int_direct<BITS, S, 1, NT>(p, qx, n0);
    case 2:
      return int_direct<BITS, S, 2, NT>(p, qx, n0);
    case 3:
      return int_direct<BITS, S, 3, NT>(p, qx, n0);
    default:
      break;
  }
  const size_t blocks = static_cast<size_t>(qx.blocks);
  __m512i* words = scratch<__m512i>(blocks * NT * 5);
  __m512* scales = reinterpret_cast<__m512*>(words + blocks * NT * 4);
  prefetch_scales<S, NT>(p, n0);
  for (int b = 0; b < qx.blocks; ++b) {
    for (int j = 0; j < NT; ++j) {
      auto& w = *reinterpret_cast<__m512i(*)[4]>(words + (b * NT + j) * 4);
      unpack_row<BITS, S>(p, n0 + j, b, w, scales[b * NT + j]);
    }
  }
  const Unpacked u{words, scales};
  int m = 0;
  for (; m + 4 <= p.M; m += 4) int_tile<S, 4, NT>(p, qx, u, m, n0);
  switch (p.M - m) {
    case 3:
      int_tile<S, 3, NT>(p, qx, u, m, n0);
      break;
    case 2:
      int_tile<S, 2, NT>(p, qx, u, m, n0);
      break;
    case 1:
      int_tile<S, 1, NT>(p, qx, u, m, n0);
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
  if (p.qx != nullptr && p.M >= PAIR_MIN_M && p.M <= PAIR_MAX_M) {
    for (; n + 2 <= n_end; n += 2) pair_tiles<BITS, S, 2>(p, *p.qx, n);
    if (n < n_end) pair_tiles<BITS, S, 1>(p, *p.qx, n);
    return;
  }
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

// Rows of x above which prefill_gemm.cpp's int8 GEMM takes the product where built.
constexpr int PREFILL_MIN_M = 64;

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
  if (p.M > PREFILL_MIN_M &&
      prefill_qmm({p.x, p.w, p.scales, p.biases, p.out, p.M, p.K, p.N, p.group_size, bits, half_scales})) {
    return;  // a prompt chunk: the int8 GEMM (prefill_gemm.cpp)
  }
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
  p.zero = -static_cast<float>(1 << (a.bits - 1));
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
    p.biases = biases.size() > 0 ? biases.data<void>() : nullptr;  // empty: symmetric
    p.zero = -static_cast<float>(1 << (bits_ - 1));
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
  const bool symmetric = biases.size() == 0;  // bias = -2^(bits - 1) x scale (Q8_0, Q4_0, Q5_0)
  check(symmetric || biases.shape() == scales.shape(), "biases must have the scales' shape");
  check((symmetric || scales.dtype() == biases.dtype()) &&
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

