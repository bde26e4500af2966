// Prompt chunks (more rows of x than the decode paths take): y = x @ dequantize(w).T on
// MLX's affine layout as an int8 GEMM with AVX512-VNNI vpdpbusd, as llama.cpp multiplies
// prompts: each row of x is rounded to int8 per weight group (scale = the group's largest
// magnitude / 127) per run of 32 values, like llama.cpp's Q8_0 activations, whatever
// the weights' group size (an outlier column coarsens only its own 32 values); the
// weights' unsigned integers (4, 5 or 8 bits) are the other operand as they are, 64
// exact multiply-adds per instruction. Per output, group g and run c of the group:
//     scale[n, g] * xscale[m, c] * (q[n, c] . xq[m, c]) + bias[n, g] * xsum[m, g]
// with xsum the sum of the rounded x, so the result is exactly the product of the
// rounded x (float32 accumulation over runs and groups).
//
// Layout: the output columns are the vector lanes. A block of 32 weight rows is unpacked
// once into a buffer that stays in L2 ([K / 4][32 rows][4 bytes]: the four values one
// vpdpbusd lane multiplies), its scales and biases into float32 ([G][32]); then tiles of
// up to 6 rows of x x 32 columns stream past it, 4 values of a row of x broadcast to all
// lanes, int32 sums per group converted and scaled once. Blocks are claimed by the
// kernels' pool. Built only where the compiler targets AVX512-VNNI (the build picks its
// flags from /proc/cpuinfo); elsewhere, for a NaN or infinity in x, or when switched off,
// prefill_qmm returns false and the caller takes its float path.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#include "kernels.h"
#include "simd512.h"

namespace pipeserve {

namespace {
std::atomic<bool> enabled{true};
std::atomic<bool> int8_x{false};
}  // namespace

void set_prefill_gemm(bool on) { enabled.store(on); }
bool prefill_gemm_enabled() { return enabled.load(); }
void set_prefill_int8(bool on) { int8_x.store(on); }
bool prefill_int8() { return int8_x.load(); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)

bool prefill_gemm_built() { return true; }

namespace {

constexpr int NB = 32;  // weight rows (output columns) per block: two vectors of 16
constexpr int MT = 6;  // rows of x per tile (int8 x)
constexpr int MT_SPLIT = 4;  // with int16 x (two int8 halves): 24 accumulators

constexpr int RUN = 32;  // values of x per activation scale

// How x is rounded: to int16 per run (the default: 2^-15 of the run's largest magnitude,
// as the decode paths round it), split into two int8 halves v = 256 hi + lo that go
// through vpdpbusd each (twice the instructions of int8); or to int8 per run
// (llama.cpp's Q8_0 activations; PIPESERVE_PREFILL_GEMM=int8).
constexpr float INT16_LEVELS = 32639.0f;  // 127 * 257: hi in [-127, 127], lo in [-128, 127]
constexpr float INT8_LEVELS = 127.0f;

struct Int8X {
  std::vector<int8_t> q;  // (M, K): hi halves (int16) or the values (int8)
  std::vector<int8_t> lo;  // (M, K): lo halves (int16 only)
  std::vector<float> scale;  // (M, K / RUN)
  std::vector<float> sum;  // (M, G): sums of the rounded x per weight group
};

// One run of 32 values rounded: stores q (and lo), returns the sum of the rounded values.
template <bool SPLIT>
int32_t round_run(const float* v, __m512 inv, int8_t* q, int8_t* lo) {
  __m512i total = _mm512_setzero_si512();
  for (int k = 0; k < RUN; k += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + k), inv));
    total = _mm512_add_epi32(total, r);
    if constexpr (SPLIT) {
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(r, _mm512_set1_epi32(128)), 8);
      const __m512i low = _mm512_sub_epi32(r, _mm512_slli_epi32(hi, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtepi32_epi8(low));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(r));
    }
  }
  return _mm512_reduce_add_epi32(total);
}

// Rounds x per run of 32; false when x holds a NaN or an infinity.
template <bool SPLIT>
bool quantize_rows(const float* x, int M, int K, int group_size, Int8X& qx) {
  const int G = K / group_size, runs = K / RUN;
  const float levels = SPLIT ? INT16_LEVELS : INT8_LEVELS;
  qx.q.resize(static_cast<size_t>(M) * K);
  qx.lo.resize(SPLIT ? static_cast<size_t>(M) * K : 0);
  qx.scale.resize(static_cast<size_t>(M) * runs);
  qx.sum.assign(static_cast<size_t>(M) * G, 0.0f);
  std::atomic<bool> finite{true};
  parallel_for((M + 15) / 16, [&](int chunk) {
    __mmask16 bad = 0;
    for (int m = chunk * 16; m < std::min(M, chunk * 16 + 16); ++m) {
      for (int c = 0; c < runs; ++c) {
        const size_t at = static_cast<size_t>(m) * K + static_cast<size_t>(c) * RUN;
        const float* v = x + at;
        __m512 peak = _mm512_setzero_ps();
        for (int k = 0; k < RUN; k += 16) {
          const __m512 a = _mm512_loadu_ps(v + k);
          bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_setzero_ps(), _CMP_NEQ_UQ);
          peak = _mm512_max_ps(peak, _mm512_abs_ps(a));
        }
        const float amax = _mm512_reduce_max_ps(peak);
        const float d = amax / levels;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
        const int32_t total = round_run<SPLIT>(v, inv, qx.q.data() + at, SPLIT ? qx.lo.data() + at : nullptr);
        qx.scale[static_cast<size_t>(m) * runs + c] = d;
        qx.sum[static_cast<size_t>(m) * G + c * RUN / group_size] += d * static_cast<float>(total);
      }
    }
    if (bad) finite.store(false);
  });
  return finite.load();
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Row n's K values, one byte each.
template <int BITS>
void unpack_row(const uint8_t* w, int K, uint8_t* out) {
  if constexpr (BITS == 8) {
    std::memcpy(out, w, K);
  } else if constexpr (BITS == 4) {
    // byte b holds values 2b (low nibble) and 2b + 1
    const __m512i low = _mm512_set1_epi16(0x000f), high = _mm512_set1_epi16(0x0f00);
    int k = 0;
    for (; k + 64 <= K; k += 64) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k / 2)));
      const __m512i v = _mm512_or_si512(_mm512_and_si512(b, low),
                                        _mm512_and_si512(_mm512_slli_epi16(b, 4), high));
      _mm512_storeu_si512(out + k, v);
    }
    for (; k < K; k += 2) {
      out[k] = w[k / 2] & 0x0f;
      out[k + 1] = w[k / 2] >> 4;
    }
  } else {
    // 5 bytes hold 8 values (little-endian bit stream)
    for (int k = 0; k < K; k += 8) {
      uint64_t raw = 0;
      std::memcpy(&raw, w + k / 8 * 5, 5);
      const uint64_t spread = _pdep_u64(raw, 0x1f1f1f1f1f1f1f1fULL);
      std::memcpy(out + k, &spread, 8);
    }
  }
}

template <typename S>
inline float to_f32(S v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return half_to_float(v);
  }
}

struct Block {
  uint32_t* words;  // (K / 4, NB): four values of row j at [k4 * NB + j]
  float* scales;  // (G, NB)
  float* biases;  // (G, NB)
};

// Rows n0 .. n0 + NB - 1's scales and biases into the block (rows past N: zeros).
template <int BITS, typename S>
void block_scales(const QmmRows& a, int n0, Block blk) {
  const int G = a.K / a.group_size;
  const S* scales = static_cast<const S*>(a.scales);
  const S* biases = static_cast<const S*>(a.biases);  // null: symmetric (Q8_0, Q4_0, Q5_0)
  const float zero = -static_cast<float>(1 << (BITS - 1));  // a symmetric bias per unit of scale
  for (int j = 0; j < NB; ++j) {
    const int n = n0 + j;
    for (int g = 0; g < G; ++g) {
      const size_t at = static_cast<size_t>(n) * G + g;
      blk.scales[g * NB + j] = n < a.N ? to_f32(scales[at]) : 0.0f;
      if (n >= a.N) {
        blk.biases[g * NB + j] = 0.0f;
      } else {
        blk.biases[g * NB + j] = biases ? to_f32(biases[at]) : zero * blk.scales[g * NB + j];
      }
    }
  }
}

// Weight row n (one byte a value) into row; zeros past N.
template <int BITS>
void weight_row(const QmmRows& a, int n, uint8_t* row) {
  const size_t row_bytes = static_cast<size_t>(a.K) * BITS / 8;
  if (n < a.N) {
    unpack_row<BITS>(static_cast<const uint8_t*>(a.w) + n * row_bytes, a.K, row);
  } else {
    std::memset(row, 0, a.K);
  }
}

// Rows n0 .. n0 + NB - 1 into the block buffer (rows past N: zeros).
template <int BITS, typename S>
void unpack_block(const QmmRows& a, int n0, Block blk, uint8_t* row) {
  for (int j = 0; j < NB; ++j) {
    weight_row<BITS>(a, n0 + j, row);
    const uint32_t* r = reinterpret_cast<const uint32_t*>(row);
    for (int k4 = 0; k4 < a.K / 4; ++k4) blk.words[static_cast<size_t>(k4) * NB + j] = r[k4];
  }
  block_scales<BITS, S>(a, n0, blk);
}

// Rows m0 .. m0 + R - 1 of x against the block: out columns n0 .. n0 + NB - 1.
template <int R, bool SPLIT>
void tile(const QmmRows& a, const Int8X& qx, const Block& blk, int m0, int n0) {
  const int G = a.K / a.group_size, runs = a.K / RUN, per_group = a.group_size / RUN;
  constexpr int steps = RUN / 4;
  __m512 acc[R][2];
  PIPESERVE_UNROLL
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int8_t* xrow[R];
  const int8_t* xlow[R];
  for (int i = 0; i < R; ++i) {
    xrow[i] = qx.q.data() + static_cast<size_t>(m0 + i) * a.K;
    xlow[i] = SPLIT ? qx.lo.data() + static_cast<size_t>(m0 + i) * a.K : nullptr;
  }
  for (int c = 0; c < runs; ++c) {
    const int g = c / per_group;
    __m512i dot[R][2], low[SPLIT ? R : 1][2];
    PIPESERVE_UNROLL
    for (int i = 0; i < R; ++i) dot[i][0] = dot[i][1] = _mm512_setzero_si512();
    if constexpr (SPLIT) {
      PIPESERVE_UNROLL
      for (int i = 0; i < R; ++i) low[i][0] = low[i][1] = _mm512_setzero_si512();
    }
    const uint32_t* wp = blk.words + static_cast<size_t>(c) * steps * NB;
    const int kx = c * RUN;
    PIPESERVE_UNROLL
    for (int s = 0; s < steps; ++s) {
      const __m512i w0 = _mm512_load_si512(wp + s * NB);
      const __m512i w1 = _mm512_load_si512(wp + s * NB + 16);
      PIPESERVE_UNROLL
      for (int i = 0; i < R; ++i) {
        int32_t four;
        std::memcpy(&four, xrow[i] + kx + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        dot[i][0] = _mm512_dpbusd_epi32(dot[i][0], w0, xb);
        dot[i][1] = _mm512_dpbusd_epi32(dot[i][1], w1, xb);
        if constexpr (SPLIT) {
          std::memcpy(&four, xlow[i] + kx + 4 * s, 4);
          const __m512i xl = _mm512_set1_epi32(four);
          low[i][0] = _mm512_dpbusd_epi32(low[i][0], w0, xl);
          low[i][1] = _mm512_dpbusd_epi32(low[i][1], w1, xl);
        }
      }
    }
    if constexpr (SPLIT) {  // 256 hi + lo: |sum| <= 32 * 32639 * 255 < 2^31
      PIPESERVE_UNROLL
      for (int i = 0; i < R; ++i) {
        dot[i][0] = _mm512_add_epi32(_mm512_slli_epi32(dot[i][0], 8), low[i][0]);
        dot[i][1] = _mm512_add_epi32(_mm512_slli_epi32(dot[i][1], 8), low[i][1]);
      }
    }
    const __m512 s0 = _mm512_load_ps(blk.scales + g * NB), s1 = _mm512_load_ps(blk.scales + g * NB + 16);
    PIPESERVE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 xs = _mm512_set1_ps(qx.scale[static_cast<size_t>(m0 + i) * runs + c]);
      acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), _mm512_mul_ps(s0, xs), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][1]), _mm512_mul_ps(s1, xs), acc[i][1]);
    }
    if ((c + 1) % per_group == 0) {  // the group's bias term
      const __m512 b0 = _mm512_load_ps(blk.biases + g * NB), b1 = _mm512_load_ps(blk.biases + g * NB + 16);
      PIPESERVE_UNROLL
      for (int i = 0; i < R; ++i) {
        const __m512 xsum = _mm512_set1_ps(qx.sum[static_cast<size_t>(m0 + i) * G + g]);
        acc[i][0] = _mm512_fmadd_ps(b0, xsum, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(b1, xsum, acc[i][1]);
      }
    }
  }
  const int valid = std::min(NB, a.N - n0);
  const __mmask16 m0mask = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 m1mask = valid >= 32 ? 0xffff
                           : valid <= 16 ? 0
                                         : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  for (int i = 0; i < R; ++i) {
    float* out = a.out + static_cast<size_t>(m0 + i) * a.N + n0;
    _mm512_mask_storeu_ps(out, m0mask, acc[i][0]);
    _mm512_mask_storeu_ps(out + 16, m1mask, acc[i][1]);
  }
}

template <bool SPLIT>
void rows_past_block(const QmmRows& a, const Int8X& qx, const Block& blk, int n0) {
  constexpr int T = SPLIT ? MT_SPLIT : MT;
  int m = 0;
  for (; m + T <= a.M; m += T) tile<T, SPLIT>(a, qx, blk, m, n0);
  switch (a.M - m) {
    case 5: return tile<5, SPLIT>(a, qx, blk, m, n0);
    case 4: return tile<4, SPLIT>(a, qx, blk, m, n0);
    case 3: return tile<3, SPLIT>(a, qx, blk, m, n0);
    case 2: return tile<2, SPLIT>(a, qx, blk, m, n0);
    case 1: return tile<1, SPLIT>(a, qx, blk, m, n0);
    default: return;
  }
}

// A thread's block buffer, 64-byte aligned.
uint8_t* block_scratch(size_t bytes) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> memory;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    memory.reset(std::aligned_alloc(64, rounded));
    if (!memory) throw std::bad_alloc();
    capacity = rounded;
  }
  return static_cast<uint8_t*>(memory.get());
}

template <int BITS, typename S, bool SPLIT>
void run_blocks(const QmmRows& a, const Int8X& qx) {
  const int G = a.K / a.group_size;
  const int blocks = (a.N + NB - 1) / NB;
  parallel_for(blocks, [&](int b) {
    const size_t word_bytes = static_cast<size_t>(a.K) * NB;  // K / 4 words x NB x 4 bytes
    const size_t scale_bytes = static_cast<size_t>(G) * NB * sizeof(float);
    uint8_t* mem = block_scratch(word_bytes + 2 * scale_bytes + static_cast<size_t>(a.K) + 64);
    Block blk{reinterpret_cast<uint32_t*>(mem), reinterpret_cast<float*>(mem + word_bytes),
              reinterpret_cast<float*>(mem + word_bytes + scale_bytes)};
    uint8_t* row = mem + word_bytes + 2 * scale_bytes;
    unpack_block<BITS, S>(a, b * NB, blk, row);
    rows_past_block<SPLIT>(a, qx, blk, b * NB);
  });
}

// AMX tiles (where the kernel lets this process use them): the same integer products, 16
// weight rows x 16 rows of x x one run of 32 per tile instruction, for the int16 x. A block
// of 32 weight rows is unpacked row by row ([32][K] bytes: the A tiles, 16 rows x 32
// bytes); x is laid out per 16 rows and run as B tiles ([8][16 rows][4 bytes], hi and lo
// halves apart), its scales and group sums per 16 rows as vectors. Each run's int32 tiles
// (hi and lo, two halves of the block) are stored and joined, converted and scaled with the
// very operations of the vector path (fma(float(256 hi + lo), scale x xscale, acc), the
// bias term per group), so the outputs are the same to the bit.
#define PIPESERVE_AMX __attribute__((target("amx-tile,amx-int8")))

std::atomic<bool> amx_on{true};

bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct AmxX {
  std::vector<int8_t> hi, lo;  // (M / 16, runs, 8, 16, 4)
  std::vector<float> scale;  // (M / 16, runs, 16)
  std::vector<float> sum;  // (M / 16, G, 16)
};

void amx_layout(const QmmRows& a, const Int8X& qx, AmxX& t) {
  const int runs = a.K / RUN, G = a.K / a.group_size, blocks = (a.M + 15) / 16;
  t.hi.assign(static_cast<size_t>(blocks) * 16 * a.K, 0);
  t.lo.assign(t.hi.size(), 0);
  t.scale.assign(static_cast<size_t>(blocks) * runs * 16, 0.0f);
  t.sum.assign(static_cast<size_t>(blocks) * G * 16, 0.0f);
  AmxX* out = &t;
  parallel_for(blocks, [&](int mb) {
    for (int m = 0; m < std::min(16, a.M - mb * 16); ++m) {
      const size_t row = static_cast<size_t>(mb * 16 + m);
      for (int c = 0; c < runs; ++c) {
        for (int k4 = 0; k4 < RUN / 4; ++k4) {
          const size_t to = ((static_cast<size_t>(mb) * runs + c) * 8 + k4) * 64 + m * 4;
          const size_t from = row * a.K + c * RUN + k4 * 4;
          std::memcpy(out->hi.data() + to, qx.q.data() + from, 4);
          std::memcpy(out->lo.data() + to, qx.lo.data() + from, 4);
        }
        out->scale[(static_cast<size_t>(mb) * runs + c) * 16 + m] = qx.scale[row * runs + c];
      }
      for (int g = 0; g < G; ++g) out->sum[(static_cast<size_t>(mb) * G + g) * 16 + m] = qx.sum[row * G + g];
    }
  });
}

struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

PIPESERVE_AMX void amx_configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = RUN;  // weights: 16 rows x 32 bytes
  for (int t : {2, 3}) c.rows[t] = RUN / 4, c.colsb[t] = 64;  // x: 8 x (16 rows x 4 bytes)
  for (int t = 4; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;  // 16 x 16 int32
  _tile_loadconfig(&c);
}

// Rows mb * 16 .. + 15 of x against half h of the block's weight rows (16 rows; rows:
// [32][K] bytes); the 16 outputs per weight row accumulate in registers over the runs.
PIPESERVE_AMX void amx_tile(const QmmRows& a, const AmxX& x, const Block& blk, const uint8_t* rows,
                            int mb, int n0, int h) {
  const int runs = a.K / RUN, G = a.K / a.group_size, per_group = a.group_size / RUN;
  alignas(64) int32_t c[2][16][16];  // hi, lo: [weight row][row of x]
  __m512 acc[16];  // [weight row]: lanes are rows of x
  PIPESERVE_UNROLL
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const uint8_t* w = rows + static_cast<size_t>(16 * h) * a.K;
  const float* scales = blk.scales + 16 * h;
  const float* biases = blk.biases + 16 * h;
  for (int r = 0; r < runs; ++r) {
    const int g = r / per_group;
    const size_t xb = (static_cast<size_t>(mb) * runs + r) * 8 * 64;
    _tile_loadd(0, w + r * RUN, a.K);
    _tile_loadd(2, x.hi.data() + xb, 64);
    _tile_loadd(3, x.lo.data() + xb, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbusd(4, 0, 2);
    _tile_dpbusd(5, 0, 3);
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    const __m512 xs = _mm512_loadu_ps(x.scale.data() + (static_cast<size_t>(mb) * runs + r) * 16);
    PIPESERVE_UNROLL
    for (int j = 0; j < 16; ++j) {
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[0][j]), 8),
                                           _mm512_load_si512(c[1][j]));
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scales[g * NB + j]), xs);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[j]);
    }
    if ((r + 1) % per_group == 0) {
      const __m512 xsum = _mm512_loadu_ps(x.sum.data() + (static_cast<size_t>(mb) * G + g) * 16);
      PIPESERVE_UNROLL
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(biases[g * NB + j]), xsum, acc[j]);
    }
  }
  alignas(64) float done[16][16];
  PIPESERVE_UNROLL
  for (int j = 0; j < 16; ++j) _mm512_store_ps(done[j], acc[j]);
  const int valid = std::min(16, a.N - n0 - 16 * h);
  for (int m = 0; m < std::min(16, a.M - mb * 16); ++m) {
    float* out = a.out + static_cast<size_t>(mb * 16 + m) * a.N + n0 + 16 * h;
    for (int j = 0; j < valid; ++j) out[j] = done[j][m];
  }
}

template <int BITS, typename S>
PIPESERVE_AMX void amx_block(const QmmRows& a, const AmxX& x, int b) {
  const int G = a.K / a.group_size;
  const size_t row_bytes = static_cast<size_t>(a.K) * NB;
  const size_t scale_bytes = static_cast<size_t>(G) * NB * sizeof(float);
  uint8_t* mem = block_scratch(row_bytes + 2 * scale_bytes + 64);
  Block blk{nullptr, reinterpret_cast<float*>(mem + row_bytes),
            reinterpret_cast<float*>(mem + row_bytes + scale_bytes)};
  for (int j = 0; j < NB; ++j) weight_row<BITS>(a, b * NB + j, mem + static_cast<size_t>(j) * a.K);
  block_scales<BITS, S>(a, b * NB, blk);
  amx_configure();
  for (int mb = 0; mb < (a.M + 15) / 16; ++mb) {
    amx_tile(a, x, blk, mem, mb, b * NB, 0);
    if (a.N - b * NB > 16) amx_tile(a, x, blk, mem, mb, b * NB, 1);
  }
  _tile_release();
}

template <int BITS, typename S>
void amx_blocks(const QmmRows& a, const AmxX& x) {
  parallel_for((a.N + NB - 1) / NB, [&](int b) { amx_block<BITS, S>(a, x, b); });
}

template <typename S>
void amx_bits(const QmmRows& a, const AmxX& x) {
  switch (a.bits) {
    case 4: return amx_blocks<4, S>(a, x);
    case 5: return amx_blocks<5, S>(a, x);
    default: return amx_blocks<8, S>(a, x);
  }
}

template <typename S, bool SPLIT>
void run_bits(const QmmRows& a, const Int8X& qx) {
  switch (a.bits) {
    case 4: return run_blocks<4, S, SPLIT>(a, qx);
    case 5: return run_blocks<5, S, SPLIT>(a, qx);
    default: return run_blocks<8, S, SPLIT>(a, qx);
  }
}

template <bool SPLIT>
bool multiply(const QmmRows& a) {
  thread_local Int8X qx;
  if (!quantize_rows<SPLIT>(a.x, a.M, a.K, a.group_size, qx)) return false;
  if (SPLIT && amx_on.load(std::memory_order_relaxed) && amx_permitted()) {
    thread_local AmxX x;
    amx_layout(a, qx, x);
    if (a.half_scales) {
      amx_bits<uint16_t>(a, x);
    } else {
      amx_bits<float>(a, x);
    }
    return true;
  }
  if (a.half_scales) {
    run_bits<uint16_t, SPLIT>(a, qx);
  } else {
    run_bits<float, SPLIT>(a, qx);
  }
  return true;
}

}  // namespace

void set_prefill_amx(bool on) { amx_on.store(on); }
bool prefill_amx() { return amx_on.load() && amx_permitted(); }

bool prefill_qmm(const QmmRows& a) {
  if (!enabled.load(std::memory_order_relaxed)) return false;
  if (a.group_size % 32 != 0 || a.K % a.group_size != 0) return false;
  if (a.bits != 4 && a.bits != 5 && a.bits != 8) return false;
  return int8_x.load(std::memory_order_relaxed) ? multiply<false>(a) : multiply<true>(a);
}

#else

bool prefill_gemm_built() { return false; }
bool prefill_qmm(const QmmRows&) { return false; }
void set_prefill_amx(bool) {}
bool prefill_amx() { return false; }

#endif

}  // namespace pipeserve
