// Native CPU kernels, as XLA FFI custom calls (llmserve/ops/cpu_kernels.py builds, loads and
// calls them):
//   LlmservePagedAttention: paged GQA attention (decode, verify, per-token queries);
//   LlmserveRowLogsumexp:   log-sum-exp of each row of [B, V] float32 logits, in a fixed order;
//   LlmserveRowArgmax:      first index of each row's maximum (jnp.argmax), one pass per row;
//   LlmserveSample:         temperature, top-k, top-p, min-p and the categorical draw per row;
//   LlmserveMatmulBf16 / F32 / BlockedMany: weight matmuls with float32 accumulation
//                           (AVX512_BF16, AMX tiles where the CPU has them, AVX-512F, AVX2).
//
// Paged attention. Why a hand-written kernel: the XLA path (gather the pages through the block table, then two
// batched matmuls) costs 7-9x the memory roof on CPU, and the gather alone 2.3-5x. Here each
// (sequence, kv head) pair walks its own pages in place: every K/V byte is read once, converted
// to float32 in a block of L keys that stays in L1, and scored by all T*G query rows sharing that
// kv head (the GQA row trick of the Pallas kernel), with an online softmax per page.
//
// Semantics (shared by every backend): query t of sequence b sits at position q_start[b] + t and
// sees keys s <= q_start[b] + t and s < lengths[b]; a query that sees no key returns zeros.
//
// Batch invariance: a (sequence, kv head) item's arithmetic depends only on its own inputs, in a
// fixed order (pages in table order, keys in page order, the head dim in fixed SIMD lanes), so a
// row's result never depends on the other rows of the batch or on how items are spread over
// threads.
//
// Layout: q [B, T, N, H] (f32 or bf16), pages [K, P, L, H] (f32, bf16, or u16 = bf16 bits),
// block_tables [B, M] s32, q_start [B] s32, lengths [B] s32 -> out [B, T, N, H] like q.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <numeric>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>  // arch_prctl: the AMX tile state (AmxPermitted)
#include <unistd.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The AVX2 + FMA matmuls (below): CPUs without AVX-512 (AMD Zen 2/3, older Intel).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define LLMSERVE_AVX2_MATMUL 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Forced inlining: the attention's per-page helpers keep a row group's accumulators in registers
// only when inlined into their caller's loop.
#define LLMSERVE_INLINE inline __attribute__((always_inline))
#define LLMSERVE_LAMBDA_INLINE __attribute__((always_inline))

constexpr float kMinusInf = -1e30f;  // finite: exp(m_old - m_new) stays defined

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even, like XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 (softmax arguments), vectorizable: 2^n * poly(r), r = x - n ln2 in
// [-ln2/2, ln2/2], degree-6 Taylor polynomial (relative error ~1e-7, about one float32 ulp);
// 0 below -87.
inline float ExpNonPositive(float arg) {
  const float x = arg < -87.0f ? -87.0f : arg;
  const float t = x * 1.44269504088896341f;
  const int n = static_cast<int>(t - 0.5f);  // round half down: x <= 0, so t <= 0
  const float fn = static_cast<float>(n);
  const float r = (x - fn * 0.693145751953125f) - fn * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return arg < -87.0f ? 0.0f : p * scale;  // below float32's normal range (and -inf): 0
}

inline void LoadRow(const float* src, float* dst, int64_t h) {
  std::memcpy(dst, src, h * sizeof(float));
}

inline void LoadRow(const uint16_t* src, float* dst, int64_t h) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) dst[i] = Bf16ToF32(src[i]);
}

inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t x) { return Bf16ToF32(x); }

inline void StoreRow(const float* src, float* dst, int64_t h) {
  std::memcpy(dst, src, h * sizeof(float));
}

inline void StoreRow(const float* src, uint16_t* dst, int64_t h) {
  for (int64_t i = 0; i < h; ++i) dst[i] = F32ToBf16(src[i]);
}

// 16 x 16 float32 transpose with GCC vector extensions (vpermt2ps on AVX-512): four stages,
// each swapping the off-diagonal s x s blocks (s = 8, 4, 2, 1) of every 2s x 2s block.
typedef float V16f __attribute__((vector_size(64)));
typedef int32_t V16i __attribute__((vector_size(64)));
typedef uint16_t V16h __attribute__((vector_size(32)));
typedef uint32_t V16u __attribute__((vector_size(64)));

template <int kS>
inline void SwapBlocks(V16f* v) {
  // new_i[x] = x & s ? v_j[x - s] : v_i[x];  new_j[x] = x & s ? v_j[x] : v_i[x + s]  (j = i + s)
  constexpr V16i lo = {(0 & kS) ? 16 + 0 - kS : 0, (1 & kS) ? 16 + 1 - kS : 1,
                       (2 & kS) ? 16 + 2 - kS : 2, (3 & kS) ? 16 + 3 - kS : 3,
                       (4 & kS) ? 16 + 4 - kS : 4, (5 & kS) ? 16 + 5 - kS : 5,
                       (6 & kS) ? 16 + 6 - kS : 6, (7 & kS) ? 16 + 7 - kS : 7,
                       (8 & kS) ? 16 + 8 - kS : 8, (9 & kS) ? 16 + 9 - kS : 9,
                       (10 & kS) ? 16 + 10 - kS : 10, (11 & kS) ? 16 + 11 - kS : 11,
                       (12 & kS) ? 16 + 12 - kS : 12, (13 & kS) ? 16 + 13 - kS : 13,
                       (14 & kS) ? 16 + 14 - kS : 14, (15 & kS) ? 16 + 15 - kS : 15};
  constexpr V16i hi = {(0 & kS) ? 16 + 0 : 0 + kS, (1 & kS) ? 16 + 1 : 1 + kS,
                       (2 & kS) ? 16 + 2 : 2 + kS, (3 & kS) ? 16 + 3 : 3 + kS,
                       (4 & kS) ? 16 + 4 : 4 + kS, (5 & kS) ? 16 + 5 : 5 + kS,
                       (6 & kS) ? 16 + 6 : 6 + kS, (7 & kS) ? 16 + 7 : 7 + kS,
                       (8 & kS) ? 16 + 8 : 8 + kS, (9 & kS) ? 16 + 9 : 9 + kS,
                       (10 & kS) ? 16 + 10 : 10 + kS, (11 & kS) ? 16 + 11 : 11 + kS,
                       (12 & kS) ? 16 + 12 : 12 + kS, (13 & kS) ? 16 + 13 : 13 + kS,
                       (14 & kS) ? 16 + 14 : 14 + kS, (15 & kS) ? 16 + 15 : 15 + kS};
  for (int i = 0; i < 16; ++i) {
    if (i & kS) continue;
    const V16f a = v[i], b = v[i + kS];
    v[i] = __builtin_shuffle(a, b, lo);
    v[i + kS] = __builtin_shuffle(a, b, hi);
  }
}

inline V16f Load16(const float* p) {
  V16f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline V16f Load16(const uint16_t* p) {  // bf16 bits -> float32
  V16h x;
  std::memcpy(&x, p, sizeof(x));
  const V16u wide = __builtin_convertvector(x, V16u) << 16;
  V16f f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// dst [H, 16] (keys contiguous) <- the 16 keys [16, H] at src (row stride h), H % 16 == 0.
template <typename PT>
inline void TransposePage16(const PT* src, int64_t h, float* dst) {
  for (int64_t e0 = 0; e0 < h; e0 += 16) {
    V16f v[16];
    for (int i = 0; i < 16; ++i) v[i] = Load16(src + i * h + e0);
    SwapBlocks<8>(v);
    SwapBlocks<4>(v);
    SwapBlocks<2>(v);
    SwapBlocks<1>(v);
    for (int e = 0; e < 16; ++e) std::memcpy(dst + (e0 + e) * 16, &v[e], sizeof(V16f));
  }
}

// dst [H/2, 16] 32-bit bf16 pairs (keys contiguous) <- the 16 bf16 keys [16, H] at src (row
// stride h), H % 32 == 0: the layout vdpbf16ps wants for 16 keys at once.
inline void TransposePairs16(const uint16_t* src, int64_t h, uint32_t* dst) {
  for (int64_t c = 0; c < h / 32; ++c) {
    V16f v[16];
    for (int i = 0; i < 16; ++i) std::memcpy(&v[i], src + i * h + 32 * c, sizeof(V16f));
    SwapBlocks<8>(v);
    SwapBlocks<4>(v);
    SwapBlocks<2>(v);
    SwapBlocks<1>(v);
    for (int e = 0; e < 16; ++e) std::memcpy(dst + (16 * c + e) * 16, &v[e], sizeof(V16f));
  }
}

struct Dims {
  int64_t b, t, n, h, kh, pages, page_size, m, groups;
  float scale;
};

// Per-thread scratch: the item's query rows, accumulators and one page of K and V in float32.
struct Scratch {
  std::vector<float> q, acc, mx, den, kb, vb, sc;
  std::vector<int64_t> pos;
  void Reserve(const Dims& d) {
    const int64_t rows = d.t * d.groups, rows4 = (rows + 3) / 4 * 4;
    q.resize(rows4 * d.h);
    acc.resize(rows * d.h);
    mx.resize(rows4 * 8);  // the AVX-512 path: 16 floats per group of <= 4 (>= 2) rows
    den.resize(rows4 * 8);
    pos.resize(rows);
    kb.resize(d.page_size * d.h);
    vb.resize(d.page_size * d.h);
    sc.resize(rows4 * d.page_size);
  }
};

// Query tokens of sequence b inside it (positions q_start .. lengths - 1): the tokens after them
// are a step's padding (a prefill block's short tail, a verify row's unused draft slots), and
// their rows are written as zeros without reading a key. Before 2026-12-07 they attended to
// every key of the sequence like its last token, at full cost: at batch 1, a verify row whose
// device lookup found no draft paid 6 query tokens of attention for 1.
inline int64_t LiveTokens(const Dims& d, int64_t qs, int64_t len) {
  return std::min<int64_t>(std::max<int64_t>(len - qs, 0), d.t);
}

template <typename QT>
void ZeroTokens(const Dims& d, int64_t b, int64_t k, int64_t t0, QT* out) {
  const int64_t g = d.groups;
  for (int64_t t = t0; t < d.t; ++t)
    std::memset(out + ((b * d.t + t) * d.n + k * g) * d.h, 0, g * d.h * sizeof(QT));
}

// One (sequence b, kv head k) item: all T*G query rows of that head group over its pages.
// kL: the page size when known at compile time (16, the default), else 0 (read from d).
//
// Per page, K is converted into a transposed float32 block kT [H, L] (keys contiguous), so the
// scores of 4 query rows at a time are 4 x L-wide multiply-adds per head dim: no horizontal sum
// per (row, key), which dominated a dot-product formulation. V stays [L, H]: each row adds
// p[i] * V[i, :] with H-wide multiply-adds.
template <typename QT, typename PT, int kL>
void Item(const Dims& d, int64_t item, const QT* q, const PT* kp, const PT* vp,
          const int32_t* tables, const int32_t* q_start, const int32_t* lengths, QT* out,
          Scratch& s) {
  const int64_t b = item / d.kh, k = item % d.kh;
  const int64_t size = kL > 0 ? kL : d.page_size;
  const int64_t qs = q_start[b];
  const int64_t len = std::min<int64_t>(lengths[b], d.m * size);
  const int64_t live = LiveTokens(d, qs, len);
  ZeroTokens(d, b, k, live, out);
  const int64_t g = d.groups, h = d.h, rows = live * g;
  if (rows == 0) return;
  const int64_t kv_end = qs + live;  // keys 0 .. kv_end-1 are read
  const int64_t rows4 = (rows + 3) / 4 * 4;  // rows padded to a multiple of 4 (zero queries)
  std::fill(s.q.begin(), s.q.begin() + rows4 * h, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {  // row r = t*G + gi is head k*G + gi of token t
    const int64_t t = r / g, gi = r % g;
    const QT* src = q + ((b * d.t + t) * d.n + k * g + gi) * h;
    float* dst = &s.q[r * h];
    LoadRow(src, dst, h);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) dst[i] *= d.scale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * h, 0.0f);
  std::fill(s.mx.begin(), s.mx.begin() + rows, kMinusInf);
  std::fill(s.den.begin(), s.den.begin() + rows, 0.0f);
  float* kt = s.kb.data();  // [H, L]
  float* sc = s.sc.data();  // [rows4, L]
  const int64_t num_pages = kv_end > 0 ? (kv_end + size - 1) / size : 0;
  for (int64_t j = 0; j < num_pages; ++j) {
    int64_t page = tables[b * d.m + j];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), d.pages - 1);  // never read outside
    const int64_t base = ((k * d.pages + page) * size) * h;
    const int64_t nk = std::min<int64_t>(size, kv_end - j * size);
    if (j + 1 < num_pages) {  // pages are scattered: fetch the next one while this one computes
      int64_t next = tables[b * d.m + j + 1];
      next = std::min<int64_t>(std::max<int64_t>(next, 0), d.pages - 1);
      const char* nk_ptr = reinterpret_cast<const char*>(kp + ((k * d.pages + next) * size) * h);
      const char* nv_ptr = reinterpret_cast<const char*>(vp + ((k * d.pages + next) * size) * h);
      const int64_t bytes = size * h * static_cast<int64_t>(sizeof(PT));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(nk_ptr + off);
        __builtin_prefetch(nv_ptr + off);
      }
    }
    if (kL == 16 && nk == 16 && h % 16 == 0) {  // a full page: vector transpose
      TransposePage16(kp + base, h, kt);
    } else {
      for (int64_t i = 0; i < nk; ++i) {
        const PT* kr = kp + base + i * h;
        for (int64_t e = 0; e < h; ++e) kt[e * size + i] = ToF32(kr[e]);
      }
      for (int64_t i = nk; i < size; ++i) {  // keys past the end: zeros (masked below)
        for (int64_t e = 0; e < h; ++e) kt[e * size + i] = 0.0f;
      }
    }
    for (int64_t i = 0; i < nk; ++i) LoadRow(vp + base + i * h, &s.vb[i * h], h);
    for (int64_t r0 = 0; r0 < rows4; r0 += 4) {  // scores of 4 rows: sc[r, i] = q[r] . k[i]
      constexpr int64_t kW = kL > 0 ? kL : 64;  // accumulator width (registers when kL = 16)
      float a[4][kW] = {};
      const float* __restrict q0 = &s.q[r0 * h];
      const float* __restrict kt0 = kt;
      for (int64_t e = 0; e < h; ++e) {
        const float c0 = q0[e], c1 = q0[h + e], c2 = q0[2 * h + e], c3 = q0[3 * h + e];
        const float* __restrict ke = kt0 + e * size;
#pragma omp simd
        for (int64_t i = 0; i < (kL > 0 ? kL : size); ++i) {
          a[0][i] += c0 * ke[i];
          a[1][i] += c1 * ke[i];
          a[2][i] += c2 * ke[i];
          a[3][i] += c3 * ke[i];
        }
      }
      for (int64_t x = 0; x < 4; ++x) std::memcpy(sc + (r0 + x) * size, a[x], size * 4);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t q_pos = qs + r / g;
      const int64_t last = std::min(q_pos, len - 1) - j * size;  // last visible key in the page
      if (last < 0) continue;
      const int64_t ns = std::min(nk, last + 1);
      float* sr = sc + r * size;
      float m_new = s.mx[r];
      for (int64_t i = 0; i < ns; ++i) m_new = std::max(m_new, sr[i]);
      const float corr = ExpNonPositive(s.mx[r] - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < ns; ++i) {
        sr[i] = ExpNonPositive(sr[i] - m_new);
        sum += sr[i];
      }
      s.den[r] = s.den[r] * corr + sum;
      s.mx[r] = m_new;
      float* acc = &s.acc[r * h];
#pragma omp simd
      for (int64_t e = 0; e < h; ++e) acc[e] *= corr;
      for (int64_t i = 0; i < ns; ++i) {
        const float p = sr[i];
        const float* vr = &s.vb[i * h];
#pragma omp simd
        for (int64_t e = 0; e < h; ++e) acc[e] += p * vr[e];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / g, gi = r % g;
    float* acc = &s.acc[r * h];
    const float inv = s.den[r] > 0.0f ? 1.0f / s.den[r] : 0.0f;  // saw no key -> zeros
#pragma omp simd
    for (int64_t e = 0; e < h; ++e) acc[e] *= inv;
    StoreRow(acc, out + ((b * d.t + t) * d.n + k * g + gi) * h, h);
  }
}


#if defined(__AVX512F__)
// ---- AVX-512 item: pages of 16 keys, head dim 16*HV, NR query rows at a time in registers ----
//
// Same algorithm and semantics as Item below, written so that the work stays in registers: the
// NR rows' scores (one 16-key vector each), their output accumulators (NR x HV vectors) and the
// V row being added never touch memory; masks replace the scalar per-key loops. Every row's
// arithmetic is the same instruction sequence whatever NR, the batch or the thread, so the
// kernel stays batch invariant. (The generic Item accumulated P.V through memory and scalar
// loops: 3.8x the copy roof at B=32, context 512.)

inline __m512 ExpNonPositive16(__m512 arg) {  // ExpNonPositive, 16 lanes at once
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(arg, lo, _CMP_LT_OQ);  // also NaN-free: args <= 0
  const __m512 x = _mm512_max_ps(arg, lo);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512i n = _mm512_cvttps_epi32(_mm512_sub_ps(t, _mm512_set1_ps(0.5f)));
  const __m512 fn = _mm512_cvtepi32_ps(n);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mask_blend_ps(under, y, _mm512_setzero_ps());
}

// Sums each of 16 vectors in one transposing tree (45 shuffles and adds instead of 16
// horizontal reductions): the sum of a[4 p + q] lands in lane 4 q + p. Every sum stays inside
// its own vector's lanes, in a fixed order.
inline __m512 TreeSum16(const __m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // 128-bit halves: a[2i] in chunks 0-1, a[2i+1] in chunks 2-3
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // chunk c holds 4 partial lanes of a[4i + c]
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88),
                       _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

// Reduces each of 4 vectors at once (op: max or add): chunk r (lanes 4r .. 4r + 3) of the
// result holds a[r]'s reduction in all four lanes. Each vector's reduction stays inside its own
// lanes, in a fixed order (chunks 0+2 and 1+3, then the two halves, then lane pairs), so a row's
// result does not depend on the other three vectors. 13 shuffles and ops for 4 rows, against 4
// horizontal reductions of 8 each.
template <typename Op>
LLMSERVE_INLINE __m512 Reduce4(const __m512 (&a)[4], Op op) {
  const __m512 x = op(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
  const __m512 y = op(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
  const __m512 z = op(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  const __m512 w = op(z, _mm512_permute_ps(z, 0x4E));
  return op(w, _mm512_permute_ps(w, 0xB1));
}

// Row r's value of a Reduce4-layout vector (chunk r) in all 16 lanes.
inline __m512 RowLanes(__m512 v, int r) { return _mm512_permutexvar_ps(_mm512_set1_epi32(4 * r), v); }

inline __m512 LoadVec(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 LoadVec(const uint16_t* p) {  // 16 bf16 -> float32
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;  // vdpbf16ps: bf16 pairs multiplied exactly, summed in float32
#else
constexpr bool kBf16Dot = false;
#endif

// The bf16-pairs path's K block of one page: kt2 [H/2, L] 32-bit bf16 pairs (keys contiguous),
// zeros past the page's nk keys (masked later). Built once per page for every row group.
template <int HV>
LLMSERVE_INLINE void PreparePairs(const uint16_t* kpage, int64_t nk, uint32_t* kt2) {
  constexpr int64_t H = 16 * HV, L = 16;
  if (nk == L) {
    TransposePairs16(kpage, H, kt2);
    return;
  }
  for (int64_t i = 0; i < L; ++i) {
    const uint16_t* kr = kpage + i * H;
    for (int64_t e = 0; e < H / 2; ++e) {
      uint32_t pair = 0;
      if (i < nk) std::memcpy(&pair, kr + 2 * e, sizeof(pair));
      kt2[e * L + i] = pair;
    }
  }
}

#if defined(__AVX512BF16__)
// vpermt2w indices that interleave two rows a, b of 32 bf16 into pairs (a[i], b[i]): kPairLo for
// i = 0..15, kPairHi for i = 16..31 (rows k and k + 1 of a matrix -> its dim pairs).
alignas(64) constexpr uint16_t kPairLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7,
                                              39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45,
                                              14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22,
                                              54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60,
                                              29, 61, 30, 62, 31, 63};

// The bf16-pairs path's V block of one page: vt2 [L/2, H] 32-bit pairs of keys (2i, 2i + 1)
// (dims contiguous, in order), the layout vdpbf16ps wants to add two keys' p . V at once. A
// missing odd key (a partial page) is zeros; pairs past the page's keys are not written.
template <int HV>
LLMSERVE_INLINE void PrepareVPairs(const uint16_t* vpage, int64_t nk, uint32_t* vt2) {
  constexpr int64_t H = 16 * HV;
  static_assert(HV % 2 == 0, "32 bf16 dims per vector load");
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  for (int64_t i = 0; 2 * i < nk; ++i) {
    const uint16_t* a = vpage + 2 * i * H;
    const bool has_b = 2 * i + 1 < nk;
    for (int c = 0; c < HV / 2; ++c) {
      const __m512i va = _mm512_loadu_si512(a + 32 * c);
      const __m512i vb = has_b ? _mm512_loadu_si512(a + H + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt2 + (i * HV + 2 * c) * 16, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(vt2 + (i * HV + 2 * c + 1) * 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}
#endif

// Calls page(j, base, nk) for each page j of item (b, k) up to kv_end: base is the page's
// offset in the pages, nk <= L its keys (j*L .. j*L + nk). Before each call it prefetches page
// j + 1 (pages are scattered in memory) and, on the bf16-pairs path, builds the page's K and V
// blocks kt2 and vt2 (PreparePairs, PrepareVPairs), once for every row group.
template <typename QT, typename PT, int HV, typename F>
LLMSERVE_INLINE void ForEachPage(const Dims& d, int64_t b, int64_t k, int64_t kv_end,
                                 const int32_t* tables, const PT* kp, const PT* vp,
                                 uint32_t* kt2, F&& page) {
  constexpr int64_t H = 16 * HV, L = 16;
  constexpr bool kPairs = kBf16Dot && std::is_same<QT, uint16_t>::value &&
                          std::is_same<PT, uint16_t>::value;
  auto offset = [&](int64_t i) {
    int64_t p = tables[b * d.m + i];
    p = std::min<int64_t>(std::max<int64_t>(p, 0), d.pages - 1);  // never read outside
    return ((k * d.pages + p) * L) * H;
  };
  const int64_t num_pages = kv_end > 0 ? (kv_end + L - 1) / L : 0;
  for (int64_t j = 0; j < num_pages; ++j) {
    const int64_t base = offset(j);
    const int64_t nk = std::min<int64_t>(L, kv_end - j * L);
    if (j + 1 < num_pages) {
      const char* nk_ptr = reinterpret_cast<const char*>(kp + offset(j + 1));
      const char* nv_ptr = reinterpret_cast<const char*>(vp + offset(j + 1));
      constexpr int64_t bytes = L * H * static_cast<int64_t>(sizeof(PT));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(nk_ptr + off);
        __builtin_prefetch(nv_ptr + off);
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {  // both blocks in the one scratch: kt2 [H/2, L], then vt2 [L/2, H]
      PreparePairs<HV>(kp + base, nk, kt2);
      PrepareVPairs<HV>(vp + base, nk, kt2 + (H / 2) * L);
    }
#endif
    page(j, base, nk);
  }
}

// One page (keys page_start.. page_start + nk) for NR query rows: scores, an online-softmax
// update of (m, den, acc) and acc += p . V. q_scaled: the rows' queries times the scale, [NR, H]
// float32, or (kPairs) their raw bf16 queries, scored against kt2 (PreparePairs) with the scale
// applied to the scores. Every row's arithmetic is the same whatever NR or the other rows.
template <typename QT, typename PT, int HV, int NR>
LLMSERVE_INLINE void PageRows(const Dims& d, const float* q_scaled, const PT* kpage, const PT* vpage,
                     const uint32_t* kt2, int64_t nk, int64_t page_start, const int64_t* q_pos,
                     int64_t len, __m512 (&acc)[NR][HV], __m512& m, __m512& den, float* pbuf) {
  constexpr int64_t H = 16 * HV, L = 16;
  [[maybe_unused]] constexpr bool kPairs = kBf16Dot && std::is_same<QT, uint16_t>::value &&
                          std::is_same<PT, uint16_t>::value;
  __m512 s[NR];
  for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (kPairs) {  // bf16 q and K: s[r] = (q[r] . k[i]) * scale, two dims per op
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(q_scaled);  // raw bf16 pairs
    // Four partial sums a row (dim pairs e = 4i + c), added at the end in a fixed tree: one
    // running sum made a chain of H/2 dependent vdpbf16ps per row, latency-bound with 3-4 rows.
    constexpr int kC = 4;
    static_assert((H / 2) % kC == 0, "whole groups of kC dim pairs");
    __m512 sp[kC][NR];
    for (int c = 0; c < kC; ++c)
      for (int r = 0; r < NR; ++r) sp[c][r] = _mm512_setzero_ps();
    for (int64_t e0 = 0; e0 < H / 2; e0 += kC) {
      for (int c = 0; c < kC; ++c) {
        const int64_t e = e0 + c;
        const __m512bh ke = (__m512bh)_mm512_loadu_si512(kt2 + e * L);
        for (int r = 0; r < NR; ++r) {
          const __m512bh qe = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * (H / 2) + e]));
          sp[c][r] = _mm512_dpbf16_ps(sp[c][r], qe, ke);
        }
      }
    }
    const __m512 sc = _mm512_set1_ps(d.scale);
    for (int r = 0; r < NR; ++r)
      s[r] = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(sp[0][r], sp[1][r]),
                                         _mm512_add_ps(sp[2][r], sp[3][r])), sc);
  } else
#endif
  {  // s[r][i] = q[r] . k[i]: per key H/16 multiply-adds, then one tree over the 16 keys
    (void)kt2;
    for (int r = 0; r < NR; ++r) {
      __m512 qv[HV];
      for (int v = 0; v < HV; ++v) qv[v] = _mm512_loadu_ps(q_scaled + r * H + 16 * v);
      __m512 a[16];
      for (int i = 0; i < 16; ++i) {
        __m512 t = _mm512_setzero_ps();  // keys past the page's end: zero (masked below)
        if (i < nk) {
          const PT* kr = kpage + i * H;
          t = _mm512_mul_ps(qv[0], LoadVec(kr));
          for (int v = 1; v < HV; ++v) t = _mm512_fmadd_ps(qv[v], LoadVec(kr + 16 * v), t);
        }
        a[4 * (i % 4) + i / 4] = t;  // lands in lane i
      }
      s[r] = TreeSum16(a);
    }
  }
  // The online-softmax update of all NR rows at once: chunk r (lanes 4r .. 4r + 3) of m, den
  // and corr is row r's (rows NR .. 3 are empty: no key, never read).
  int64_t keys = 0;  // keys any of the rows sees in this page
  __mmask16 mask[4] = {0, 0, 0, 0};
  __m512 sm[4];
  for (int r = 0; r < 4; ++r) {
    if (r < NR) {
      const int64_t last = std::min(q_pos[r], len - 1) - page_start;  // last visible key
      const int64_t ns = std::max<int64_t>(0, std::min<int64_t>(nk, last + 1));
      keys = std::max(keys, ns);
      mask[r] = static_cast<__mmask16>((1u << ns) - 1u);
      sm[r] = _mm512_mask_blend_ps(mask[r], _mm512_set1_ps(kMinusInf), s[r]);
    } else {
      sm[r] = _mm512_set1_ps(kMinusInf);
    }
  }
  const __m512 m_old = m;
  const __m512 m_new = _mm512_max_ps(m_old, Reduce4(sm, [](__m512 a, __m512 b) LLMSERVE_LAMBDA_INLINE {
    return _mm512_max_ps(a, b); }));
  const __m512 corr = ExpNonPositive16(_mm512_sub_ps(m_old, m_new));
  __m512 p[4];
  for (int r = 0; r < 4; ++r) {
    p[r] = r < NR ? _mm512_maskz_mov_ps(mask[r], ExpNonPositive16(_mm512_sub_ps(
                        sm[r], RowLanes(m_new, r))))
                  : _mm512_setzero_ps();
  }
  den = _mm512_fmadd_ps(den, corr, Reduce4(p, [](__m512 a, __m512 b) LLMSERVE_LAMBDA_INLINE {
    return _mm512_add_ps(a, b); }));
  m = m_new;
  for (int r = 0; r < NR; ++r) {
    const __m512 c = RowLanes(corr, r);
    for (int v = 0; v < HV; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], c);
  }
#if defined(__AVX512BF16__)
  if constexpr (kPairs) {  // acc[r] += p[r] . V two keys per op: p rounded to bf16 pairs
    const uint32_t* vt2 = kt2 + (H / 2) * L;  // PrepareVPairs
    uint32_t* pp = reinterpret_cast<uint32_t*>(pbuf);
    for (int r = 0; r < NR; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + r * L), (__m256i)_mm512_cvtneps_pbh(p[r]));
    for (int64_t i = 0; 2 * i < keys; ++i) {
      __m512i vv[HV];
      for (int v = 0; v < HV; ++v) vv[v] = _mm512_loadu_si512(vt2 + (i * HV + v) * 16);
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * L + i]));
        for (int v = 0; v < HV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pr, (__m512bh)vv[v]);
      }
    }
    return;
  }
#endif
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(pbuf + r * L, p[r]);
  for (int64_t i = 0; i < keys; ++i) {  // acc[r] += p[r][i] * V[i]
    const PT* vr = vpage + i * H;
    __m512 vv[HV];
    for (int v = 0; v < HV; ++v) vv[v] = LoadVec(vr + 16 * v);
    for (int r = 0; r < NR; ++r) {
      const __m512 pv = _mm512_set1_ps(pbuf[r * L + i]);
      for (int v = 0; v < HV; ++v) acc[r][v] = _mm512_fmadd_ps(pv, vv[v], acc[r][v]);
    }
  }
}

// Rows [r0, r0 + NR) of item (b, k): out = acc / den (zeros for a row that saw no key).
template <typename QT, int HV, int NR>
LLMSERVE_INLINE void StoreRows(const Dims& d, int64_t b, int64_t k, int64_t r0,
                      const __m512 (&acc)[NR][HV], __m512 den_rows, QT* out) {
  constexpr int64_t H = 16 * HV;
  const int64_t g = d.groups;
  alignas(64) float den[16];
  _mm512_store_ps(den, den_rows);
  for (int r = 0; r < NR; ++r) {
    const int64_t row = r0 + r, t = row / g, gi = row % g;
    const float dr = den[4 * r];
    const __m512 inv = _mm512_set1_ps(dr > 0.0f ? 1.0f / dr : 0.0f);  // no key -> zeros
    alignas(64) float res[H];
    for (int v = 0; v < HV; ++v) _mm512_store_ps(res + 16 * v, _mm512_mul_ps(acc[r][v], inv));
    StoreRow(res, out + ((b * d.t + t) * d.n + k * g + gi) * H, H);
  }
}

// Rows [r0, r0 + NR) of item (b, k) over every page, their state in registers throughout: the
// path when all of an item's rows fit one group (a decode step). q_scaled as in PageRows.
template <typename QT, typename PT, int HV, int NR>
void RowsAvx512(const Dims& d, int64_t b, int64_t k, int64_t r0, const float* q_scaled,
                const PT* kp, const PT* vp, const int32_t* tables, int64_t qs, int64_t len,
                int64_t kv_end, QT* out, float* kt, float* pbuf) {
  constexpr int64_t L = 16;
  __m512 acc[NR][HV];
  __m512 m = _mm512_set1_ps(kMinusInf), den = _mm512_setzero_ps();  // chunk r: row r (PageRows)
  int64_t q_pos[NR];
  for (int r = 0; r < NR; ++r) {
    for (int v = 0; v < HV; ++v) acc[r][v] = _mm512_setzero_ps();
    q_pos[r] = qs + (r0 + r) / d.groups;
  }
  uint32_t* kt2 = reinterpret_cast<uint32_t*>(kt);
  ForEachPage<QT, PT, HV>(d, b, k, kv_end, tables, kp, vp, kt2,
                          [&](int64_t j, int64_t base, int64_t nk) LLMSERVE_LAMBDA_INLINE {
    PageRows<QT, PT, HV, NR>(d, q_scaled, kp + base, vp + base, kt2, nk, j * L, q_pos, len, acc,
                             m, den, pbuf);
  });
  StoreRows<QT, HV, NR>(d, b, k, r0, acc, den, out);
}

// Rows r0.. r0 + NR (one group) of an item with more rows than one group holds, on one page: its
// state comes from and goes back to the scratch (acc [rows, H], m, den), so each page is read
// and prepared once for every group (a verify row's 1 + R tokens, a prefill block).
template <typename QT, typename PT, int HV, int NR>
LLMSERVE_INLINE void GroupPage(const Dims& d, int64_t r0, const float* q_scaled, const PT* kpage,
                      const PT* vpage, const uint32_t* kt2, int64_t nk, int64_t page_start,
                      const int64_t* q_pos, int64_t len, float* acc_mem, float* m_mem,
                      float* den_mem, float* pbuf) {
  constexpr int64_t H = 16 * HV;
  __m512 acc[NR][HV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < HV; ++v) acc[r][v] = _mm512_loadu_ps(acc_mem + (r0 + r) * H + 16 * v);
  __m512 m = _mm512_loadu_ps(m_mem), den = _mm512_loadu_ps(den_mem);
  PageRows<QT, PT, HV, NR>(d, q_scaled, kpage, vpage, kt2, nk, page_start, q_pos + r0, len, acc,
                           m, den, pbuf);
  _mm512_storeu_ps(m_mem, m);
  _mm512_storeu_ps(den_mem, den);
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < HV; ++v) _mm512_storeu_ps(acc_mem + (r0 + r) * H + 16 * v, acc[r][v]);
}

// All rows of item (b, k), at most kMaxRows (= 16 / HV, <= 4) at a time: one group in
// registers (RowsAvx512), or, with more rows, pages outer and groups inner (GroupPage). A
// group's rows see keys up to their own positions, so groups whose rows see none of a page skip
// it (an all-masked page leaves a row's state unchanged: corr = 1, p = 0).
template <typename QT, typename PT, int HV>
void ItemAvx512(const Dims& d, int64_t item, const QT* q, const PT* kp, const PT* vp,
                const int32_t* tables, const int32_t* q_start, const int32_t* lengths, QT* out,
                Scratch& s) {
  constexpr int64_t H = 16 * HV, L = 16;
  constexpr int kMaxRows = HV >= 8 ? 2 : 4;
  const int64_t b = item / d.kh, k = item % d.kh;
  const int64_t qs = q_start[b];
  const int64_t len = std::min<int64_t>(lengths[b], d.m * 16);
  const int64_t live = LiveTokens(d, qs, len);
  ZeroTokens(d, b, k, live, out);
  const int64_t g = d.groups, rows = live * g;
  if (rows == 0) return;
  const int64_t kv_end = qs + live;  // (= min(qs + T, len): the last real token's keys)
  constexpr bool kPairs = kBf16Dot && std::is_same<QT, uint16_t>::value &&
                          std::is_same<PT, uint16_t>::value;
  constexpr int64_t kRowFloats = kPairs ? H / 2 : H;  // raw bf16 rows take half the space
  for (int64_t r = 0; r < rows; ++r) {  // row r = t*G + gi is head k*G + gi of token t
    const int64_t t = r / g, gi = r % g;
    const QT* src = q + ((b * d.t + t) * d.n + k * g + gi) * H;
    float* dst = &s.q[r * kRowFloats];
    if constexpr (kPairs) {
      std::memcpy(dst, src, H * sizeof(QT));
    } else {
      LoadRow(src, dst, H);
      for (int64_t i = 0; i < H; ++i) dst[i] *= d.scale;
    }
  }
  float* kt = s.kb.data();
  float* pb = s.sc.data();
  if (rows <= kMaxRows) {
    const float* qr = s.q.data();
    switch (rows) {
      case 1: RowsAvx512<QT, PT, HV, 1>(d, b, k, 0, qr, kp, vp, tables, qs, len, kv_end, out, kt, pb); break;
      case 2: RowsAvx512<QT, PT, HV, 2>(d, b, k, 0, qr, kp, vp, tables, qs, len, kv_end, out, kt, pb); break;
      case 3: if constexpr (kMaxRows >= 3) RowsAvx512<QT, PT, HV, 3>(d, b, k, 0, qr, kp, vp, tables, qs, len, kv_end, out, kt, pb); break;
      default: if constexpr (kMaxRows >= 4) RowsAvx512<QT, PT, HV, 4>(d, b, k, 0, qr, kp, vp, tables, qs, len, kv_end, out, kt, pb); break;
    }
    return;
  }
  float* acc = s.acc.data();
  float* m = s.mx.data();  // group r0 / kMaxRows: 16 floats at 16 * (r0 / kMaxRows), PageRows' layout
  float* den = s.den.data();
  std::vector<int64_t>& q_pos = s.pos;
  for (int64_t r = 0; r < rows; ++r) q_pos[r] = qs + r / g;
  const int64_t num_groups = (rows + kMaxRows - 1) / kMaxRows;
  std::fill(m, m + 16 * num_groups, kMinusInf);
  std::fill(den, den + 16 * num_groups, 0.0f);
  std::fill(acc, acc + rows * H, 0.0f);
  uint32_t* kt2 = reinterpret_cast<uint32_t*>(kt);
  ForEachPage<QT, PT, HV>(d, b, k, kv_end, tables, kp, vp, kt2,
                          [&](int64_t j, int64_t base, int64_t nk) LLMSERVE_LAMBDA_INLINE {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t nr = std::min<int64_t>(kMaxRows, rows - r0);
      if (std::min(q_pos[r0 + nr - 1], len - 1) < j * L) continue;  // sees none of this page
      const float* qr = &s.q[r0 * kRowFloats];
      float* gm = m + 16 * (r0 / kMaxRows);  // the group's running max and denominator
      float* gd = den + 16 * (r0 / kMaxRows);
      switch (nr) {
        case 1: GroupPage<QT, PT, HV, 1>(d, r0, qr, kp + base, vp + base, kt2, nk, j * L, q_pos.data(), len, acc, gm, gd, pb); break;
        case 2: GroupPage<QT, PT, HV, 2>(d, r0, qr, kp + base, vp + base, kt2, nk, j * L, q_pos.data(), len, acc, gm, gd, pb); break;
        case 3: if constexpr (kMaxRows >= 3) GroupPage<QT, PT, HV, 3>(d, r0, qr, kp + base, vp + base, kt2, nk, j * L, q_pos.data(), len, acc, gm, gd, pb); break;
        default: if constexpr (kMaxRows >= 4) GroupPage<QT, PT, HV, 4>(d, r0, qr, kp + base, vp + base, kt2, nk, j * L, q_pos.data(), len, acc, gm, gd, pb); break;
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / g, gi = r % g;
    const float dr = den[16 * (r / kMaxRows) + 4 * (r % kMaxRows)];
    const __m512 inv = _mm512_set1_ps(dr > 0.0f ? 1.0f / dr : 0.0f);  // no key -> zeros
    alignas(64) float res[H];
    for (int v = 0; v < HV; ++v)
      _mm512_store_ps(res + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(acc + r * H + 16 * v), inv));
    StoreRow(res, out + ((b * d.t + t) * d.n + k * g + gi) * H, H);
  }
}
#endif  // __AVX512F__

// Runs items 0..total-1 on the caller and on the XLA CPU thread pool. Participants claim items
// from a shared counter; the caller waits only for items already claimed by a running thread,
// so a pool that is busy elsewhere (or never runs the task) cannot deadlock the call.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t total, int64_t min_per_thread, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, total, fn]() {
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= total) return;
      fn(i);
      state->done.fetch_add(1);
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads, total / std::max<int64_t>(min_per_thread, 1)) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load() < total) std::this_thread::yield();
}

// Work items (column blocks of `block` columns over k) a helper thread must get to pay for
// waking it (~1 MFLOP). A block's weights stream from memory whatever the row count, so a call
// with few rows costs at least what 8 rows' FMAs would: counting its FMAs alone left 1-row
// layer matmuls on one thread, half the memory bandwidth of two (measured: SmolLM2 fp32 at
// one row 42 ms native vs 22 ms XLA).
inline int64_t MatmulMinItems(int64_t m_dim, int64_t k_dim, int64_t block) {
  const int64_t work = std::max<int64_t>(m_dim, 8) * k_dim * block;
  return std::max<int64_t>(1, (1 << 19) / std::max<int64_t>(1, work));
}

// A matmul's work items: column blocks of `block` columns, each cut into `row_chunks` chunks of
// whole 6-row tiles when the blocks alone do not divide evenly over the threads. XLA runs a
// layer's matmuls one after another, so 9 blocks on 2 threads leave one thread idle for a
// block's time at the end of every call (SmolLM2 at 256 rows: q, o and down have 9 blocks, k and
// v 3; measured in a dependent chain, k/v at 192 columns cost what 256 columns do). Only with
// >= 24 rows a chunk, where the FMAs, not the weight stream, set the time: both chunks read the
// block's weights. A row's arithmetic does not depend on its tile: the results are bitwise the
// same.
struct MatmulItems {
  int64_t col_blocks, row_chunks, chunk_rows;
  int64_t count() const { return col_blocks * row_chunks; }
  // Item -> columns [n0, n1) and rows [r0, r1) (r1 <= r0: nothing but the block's padding).
  void Bounds(int64_t item, int64_t block, int64_t n, int64_t m_dim, int64_t* n0, int64_t* n1,
              int64_t* r0, int64_t* r1) const {
    const int64_t cb = item / row_chunks, rc = item % row_chunks;
    *n0 = cb * block;
    *n1 = std::min(n, *n0 + block);
    *r0 = std::min(m_dim, rc * chunk_rows);
    *r1 = std::min(m_dim, *r0 + chunk_rows);
  }
};

inline MatmulItems SplitMatmul(int64_t threads, int64_t m_dim, int64_t n, int64_t block) {
  MatmulItems it{(n + block - 1) / block, 1, m_dim};
  threads = std::max<int64_t>(1, threads);
  if (threads > 1 && it.col_blocks % threads != 0 && it.col_blocks < 8 * threads) {
    const int64_t chunks = threads / std::gcd(it.col_blocks, threads);
    if (m_dim >= 24 * chunks) {
      it.row_chunks = chunks;
      it.chunk_rows = ((m_dim + chunks - 1) / chunks + 5) / 6 * 6;
    }
  }
  return it;
}

// The [K, N] matmuls run 6-row tiles at every row count. Tiles of up to 12 x 32 for calls of
// 7-24 rows (a block's weights through the registers once per 12 rows) were measured faster on
// an earlier machine but slower on this project's AMD Zen 4 CPUs (SmolLM2's weight matmuls,
// `python -m experiments.matmul --rows=6,8,10,16,24`, alternated twice: bf16 8 rows 9.1 vs
// 10.4-10.6 ms, 16 rows 11.2-11.5 vs 11.9-12.2; fp32 8 rows 15.5-15.7 vs 19.4-19.7, 16 rows
// 20.1 vs 23.3-23.8), so they went: a 6-row tile's block of weights stays in L1/L2 for the
// next row tile.

template <typename QT, typename PT>
void Run(ffi::ThreadPool& pool, const Dims& d, const void* q, const void* kp, const void* vp,
         const int32_t* tables, const int32_t* q_start, const int32_t* lengths, void* out) {
  const int64_t total = d.b * d.kh;
  // Enough work per helper to pay for waking it: about a thousand key rows.
  const int64_t keys_per_item = std::max<int64_t>(1, d.m * d.page_size);
  const int64_t min_items = std::max<int64_t>(1, 1024 / keys_per_item);
  ParallelFor(pool, total, min_items, [=](int64_t item) {
    thread_local Scratch scratch;
    scratch.Reserve(d);
#if defined(__AVX512F__)
    if (d.page_size == 16 && (d.h == 32 || d.h == 64 || d.h == 128)) {
      const QT* qq = static_cast<const QT*>(q);
      const PT* kk = static_cast<const PT*>(kp);
      const PT* vv = static_cast<const PT*>(vp);
      QT* oo = static_cast<QT*>(out);
      if (d.h == 64) {
        ItemAvx512<QT, PT, 4>(d, item, qq, kk, vv, tables, q_start, lengths, oo, scratch);
      } else if (d.h == 32) {
        ItemAvx512<QT, PT, 2>(d, item, qq, kk, vv, tables, q_start, lengths, oo, scratch);
      } else {
        ItemAvx512<QT, PT, 8>(d, item, qq, kk, vv, tables, q_start, lengths, oo, scratch);
      }
      return;
    }
#endif
    if (d.page_size == 16) {
      Item<QT, PT, 16>(d, item, static_cast<const QT*>(q), static_cast<const PT*>(kp),
                       static_cast<const PT*>(vp), tables, q_start, lengths,
                       static_cast<QT*>(out), scratch);
    } else {
      Item<QT, PT, 0>(d, item, static_cast<const QT*>(q), static_cast<const PT*>(kp),
                      static_cast<const PT*>(vp), tables, q_start, lengths,
                      static_cast<QT*>(out), scratch);
    }
  });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> lengths,
                              float scale, ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions();
  const auto pd = k_pages.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("want q [B,T,N,H], pages [K,P,L,H], tables [B,M]");
  }
  Dims d{qd[0], qd[1], qd[2], qd[3], pd[0], pd[1], pd[2], td[1], 0, scale};
  if (pd[3] != d.h || d.n % d.kh != 0 || td[0] != d.b) {
    return ffi::Error::InvalidArgument("q, pages and block tables do not match");
  }
  if (d.page_size > 64) {  // the score accumulators hold at most 64 keys
    return ffi::Error::InvalidArgument("page size must be <= 64");
  }
  if (k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("k_pages and v_pages differ in dtype");
  }
  d.groups = d.n / d.kh;
  const auto qt = q.element_type(), pt = k_pages.element_type();
  const bool page_f32 = pt == ffi::DataType::F32;
  const bool page_16 = pt == ffi::DataType::BF16 || pt == ffi::DataType::U16;
  const void* qp = q.untyped_data();
  const void* kp = k_pages.untyped_data();
  const void* vp = v_pages.untyped_data();
  const int32_t* tab = block_tables.typed_data();
  const int32_t* qs = q_start.typed_data();
  const int32_t* ln = lengths.typed_data();
  void* o = out->untyped_data();
  if (qt == ffi::DataType::F32 && page_f32) {
    Run<float, float>(pool, d, qp, kp, vp, tab, qs, ln, o);
  } else if (qt == ffi::DataType::F32 && page_16) {
    Run<float, uint16_t>(pool, d, qp, kp, vp, tab, qs, ln, o);
  } else if (qt == ffi::DataType::BF16 && page_16) {
    Run<uint16_t, uint16_t>(pool, d, qp, kp, vp, tab, qs, ln, o);
  } else if (qt == ffi::DataType::BF16 && page_f32) {
    Run<uint16_t, float>(pool, d, qp, kp, vp, tab, qs, ln, o);
  } else {
    return ffi::Error::InvalidArgument("q must be f32 or bf16; pages f32, bf16 or u16");
  }
  return ffi::Error::Success();
}


constexpr int64_t kNKPrefetch = 2;  // tiles of 4 vocabulary rows ahead (GemmNKTile*)

// The cache line at column k0 of vocabulary rows row..row + 4 of w [N, K] (the next step of the
// tile kNKPrefetch tiles ahead).
template <typename T>
LLMSERVE_INLINE void PrefetchNKTile(const T* w, int64_t row, int64_t k_dim, int64_t k0) {
  for (int j = 0; j < 4; ++j)
    __builtin_prefetch(w + (row + j) * k_dim + k0, 0, 3);
}

// The blocked weight layout: w [K, N] stored as [N / 64, K, 64], each 64-column block's K rows
// contiguous. Why: a block of the [K, N] layout is 128 (bf16) or 256 (f32) bytes of every
// N-wide row, a strided walk that this CPU's prefetchers serve at ~10 GB/s a core; a contiguous
// block streams at ~25 (a C++ harness: 1-row bf16 down projection 0.185 -> 0.058 ms, one core).
// The kernels read the same values in the same order from either layout: results are bitwise
// equal. A 3-D w is blocked (llmserve.ops.cpu_kernels.block_weight).
constexpr int64_t kBlockedColumns = 64;

// Column block n0's first weight and the row stride from there: w [K, N] read in place, or the
// blocked layout (block n0 / 64 is K contiguous rows of 64).
template <typename T>
inline const T* KNBlock(const T* w, bool blocked, int64_t k_dim, int64_t n, int64_t n0,
                        int64_t* ldw) {
  *ldw = blocked ? kBlockedColumns : n;
  return blocked ? w + (n0 / kBlockedColumns) * k_dim * kBlockedColumns : w + n0;
}

// The paired layout (bf16 only): w [K, N] stored as [N / 64, K / 2, 128], each 64-column
// block's K / 2 rows of dim pairs: element (p, 2 c + j) = w[2 p + j, c]. That is the operand
// layout of AMX's tile multiply and of vdpbf16ps, so neither kernel interleaves rows k and k + 1
// itself: the AMX kernel loads its B tiles straight from the weights (the blocked layout has to
// be interleaved first, which cost SmolLM2's 1-row layer matmuls ~40% against the AVX512_BF16
// kernel). A 3-D w whose last dim is 128 is paired (llmserve.ops.cpu_kernels.pair_weight).
constexpr int64_t kPairedWidth = 2 * kBlockedColumns;

// x [M, K] and w ([K, N], [N, K] with transpose_w, blocked [N / 64, K, 64] or, where
// allow_paired, paired [N / 64, K / 2, 128]) -> rows, K, N and the layout.
template <typename Dims>
ffi::Error MatmulDims(const Dims& xd, const Dims& wd, bool transpose_w, int64_t k_mult,
                      int64_t n_mult, int64_t* rows, int64_t* k_dim, int64_t* n, bool* blocked,
                      bool* paired = nullptr) {
  *blocked = wd.size() == 3;
  const bool is_paired = *blocked && wd[2] == kPairedWidth;
  if (paired != nullptr) *paired = is_paired;
  if (xd.size() != 2 || (wd.size() != 2 && !*blocked)) {
    return ffi::Error::InvalidArgument("want x [M,K], w 2-D (or blocked [N/64,K,64])");
  }
  *rows = xd[0];
  *k_dim = xd[1];
  if (is_paired) {
    if (paired == nullptr || transpose_w || 2 * wd[1] != *k_dim || *k_dim % k_mult != 0) {
      return ffi::Error::InvalidArgument("paired w must be bf16 [N/64, K/2, 128] with K % " +
                                         std::to_string(k_mult) + " == 0, not transposed");
    }
    *n = wd[0] * kBlockedColumns;
    return ffi::Error::Success();
  }
  if (*blocked) {
    if (transpose_w || wd[2] != kBlockedColumns || wd[1] != *k_dim || *k_dim % k_mult != 0) {
      return ffi::Error::InvalidArgument("blocked w must be [N/64, K, 64] with K % " +
                                         std::to_string(k_mult) + " == 0, not transposed");
    }
    *n = wd[0] * kBlockedColumns;
    return ffi::Error::Success();
  }
  *n = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != *k_dim || *k_dim % k_mult != 0 ||
      *n % (transpose_w ? 4 : n_mult) != 0) {
    return ffi::Error::InvalidArgument("matmul shapes: K % " + std::to_string(k_mult) + ", N % " +
                                       std::to_string(n_mult) + " ([K,N]) or N % 4 ([N,K])");
  }
  return ffi::Error::Success();
}

// A step's rows past its real tokens (its bucket's padding) cost nothing in the matmuls: ``live``
// (an int32 scalar) says how many leading rows of x are real; the rest of out is zeros, so a
// padding row's value never depends on what the step's buffers held before. Why: a decode batch
// draining from 256 rows pads to the next bucket (129 -> 192), ~15% more rows than it runs on
// the 256-request workload, and those rows cost what real ones do.
// Every tile loop below runs zero times for 0 live rows (ZeroPaddingRows then zeros all of out).
inline int64_t LiveRows(const ffi::Buffer<ffi::S32>& live, int64_t rows) {
  if (live.element_count() < 1) return rows;
  return std::min<int64_t>(std::max<int64_t>(live.typed_data()[0], 0), rows);
}

// Zeros columns [n0, n1) of out's rows [live, rows) (out [rows, n] float32).
inline void ZeroPaddingRows(float* out, int64_t live, int64_t rows, int64_t n, int64_t n0,
                            int64_t n1) {
  for (int64_t m = live; m < rows; ++m)
    std::memset(out + m * n + n0, 0, static_cast<size_t>(n1 - n0) * sizeof(float));
}

// Runs fn(x rows, row count, out rows, n0, n1) for every item of the split matmul x [m_dim, K]
// -> out [rows, n] over the pool: x and out start at the item's first row; each column block's
// padding rows [m_dim, rows) are zeroed once.
template <typename XT, typename F>
void ForEachMatmulItem(ffi::ThreadPool& pool, const XT* xp, int64_t m_dim, int64_t rows,
                       int64_t k_dim, int64_t n, int64_t block, float* op, F fn) {
  const MatmulItems split = SplitMatmul(pool.num_threads(), m_dim, n, block);
  const int64_t min_items = MatmulMinItems(split.chunk_rows, k_dim, block);
  ParallelFor(pool, split.count(), min_items, [=](int64_t item) {
    int64_t n0, n1, r0, r1;
    split.Bounds(item, block, n, m_dim, &n0, &n1, &r0, &r1);
    if (r0 == 0) ZeroPaddingRows(op, m_dim, rows, n, n0, n1);
    if (r1 > r0) fn(xp + r0 * k_dim, r1 - r0, op + r0 * n, n0, n1);
  });
}

// ---- bf16 matmul with float32 accumulation (AVX512_BF16): x [M, K] @ w -> out [M, N] f32 ----
//
// Why: XLA:CPU's bf16 dots (XNNPACK) run SmolLM2's decode-step matmuls at about a third of this
// CPU's vdpbf16ps peak. Two layouts, both read in place (no packing copy of the weights):
//   w [K, N] (a Dense kernel): rows k and k+1 of a 64-column block are interleaved into bf16
//     pairs with two unpacks, and every x row's pair (x[m, k], x[m, k+1]) multiplies them with
//     vdpbf16ps into 4 accumulators; unpack's lane order is undone once, at the store.
//   w [N, K] (the tied vocabulary projection, x @ E^T): 4 vocabulary rows x up to 6 x rows are
//     dotted 32 dims at a time, each (row, column) summed horizontally at the end; the first
//     row tile of a block prefetches the vocabulary rows it will read next.
// Work is split over XLA's thread pool by column blocks (cut into row chunks where the blocks do
// not divide over the threads: SplitMatmul); each block of weights is read from memory once and
// reused from cache by every block of x rows. A row's arithmetic never depends
// on the other rows (batch invariant).
#if defined(__AVX512BF16__)
template <int MR, int NV>
inline void GemmKNTile(const uint16_t* x, int64_t k_dim, int64_t m0, const uint16_t* wb,
                       int64_t ldw, int64_t n, int64_t n0, float* out) {
  __m512 acc[MR][2 * NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2 * NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x + m0 * k_dim);
  const int64_t pairs = k_dim / 2;
  // In the [K, N] layout the block's rows are n * 2 bytes apart: each lands on another 4 KiB
  // page, where hardware prefetchers stop, so the first row tile fetches kPrefetch pairs of
  // rows ahead itself. The blocked layout's rows are contiguous: there the hardware prefetcher
  // alone serves tiles of 3+ rows better. SmolLM2's 30 layers of blocked bf16 weights on 2
  // threads (a /tmp harness, both alternated): 6 / 12 / 16 / 32 rows 6.1-6.3 / 8.1-8.7 /
  // 9.7-10.2 / 18.5 ms without against 6.8-6.9 / 9.8-9.9 / 11.5-11.7 / 20.1 ms with; at 1-2
  // rows it still gains ~3%. A whole step's weight pass (experiments/matmul.py's, three
  // alternated runs each): 8 rows 11.7-12.8 against 13.1-15.2 ms, 6 rows 11.4-11.6 against
  // 11.6-12.7; fp32 (GemmKNTileF32, the same rule) 8 rows 20.7-21.8 against 21.4-22.9.
  constexpr int64_t kPrefetch = 32;
  const bool prefetch = m0 == 0 && (ldw != kBlockedColumns || MR < 3);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* w0 = wb + (2 * kp) * ldw;
    const uint16_t* w1 = w0 + ldw;
    if (prefetch && kp + kPrefetch < pairs) {
      const char* p0 = reinterpret_cast<const char*>(w0 + 2 * kPrefetch * ldw);
      const char* p1 = p0 + 2 * ldw;
      for (int v = 0; v < NV; ++v) {
        _mm_prefetch(p0 + 64 * v, _MM_HINT_T0);
        _mm_prefetch(p1 + 64 * v, _MM_HINT_T0);
      }
    }
    __m512i lo[NV], hi[NV];
    for (int v = 0; v < NV; ++v) {
      const __m512i r0 = _mm512_loadu_si512(w0 + 32 * v);
      const __m512i r1 = _mm512_loadu_si512(w1 + 32 * v);
      lo[v] = _mm512_unpacklo_epi16(r0, r1);
      hi[v] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * pairs + kp]));
      for (int v = 0; v < NV; ++v) {
        acc[m][2 * v] = _mm512_dpbf16_ps(acc[m][2 * v], (__m512bh)lo[v], a);
        acc[m][2 * v + 1] = _mm512_dpbf16_ps(acc[m][2 * v + 1], (__m512bh)hi[v], a);
      }
    }
  }
  // unpacklo holds columns {0-3, 8-11, 16-19, 24-27} of its 32, unpackhi the others.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int m = 0; m < MR; ++m) {
    float* o = out + (m0 + m) * n + n0;
    for (int v = 0; v < NV; ++v) {
      _mm512_storeu_ps(o + 32 * v, _mm512_permutex2var_ps(acc[m][2 * v], first, acc[m][2 * v + 1]));
      _mm512_storeu_ps(o + 32 * v + 16,
                       _mm512_permutex2var_ps(acc[m][2 * v], second, acc[m][2 * v + 1]));
    }
  }
}

template <int NV>
inline void GemmKNColumns(const uint16_t* x, int64_t m_dim, int64_t k_dim, const uint16_t* wb,
                          int64_t ldw, int64_t n, int64_t n0, float* out) {
  constexpr int kMR = 6;
  int64_t m0 = 0;
  for (; m0 + kMR <= m_dim; m0 += kMR) GemmKNTile<kMR, NV>(x, k_dim, m0, wb, ldw, n, n0, out);
  switch (m_dim - m0) {
    case 1: GemmKNTile<1, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 2: GemmKNTile<2, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 3: GemmKNTile<3, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 4: GemmKNTile<4, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 5: GemmKNTile<5, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    default: break;
  }
}

// The paired layout's 64-column block wp (K / 2 rows of 128 bf16): the tile above without its
// unpacks (the pairs are stored interleaved) and without the lane fix-up at the store. Every
// column's vdpbf16ps chain is the one GemmKNTile runs: bitwise its results.
template <int MR>
inline void GemmKNTilePaired(const uint16_t* x, int64_t k_dim, int64_t m0, const uint16_t* wp,
                             int64_t n, int64_t n0, float* out) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x + m0 * k_dim);
  const int64_t pairs = k_dim / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* row = wp + kp * 128;
    __m512i w[4];
    for (int v = 0; v < 4; ++v) w[v] = _mm512_loadu_si512(row + 32 * v);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * pairs + kp]));
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)w[v], a);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + (m0 + m) * n + n0 + 16 * v, acc[m][v]);
}

inline void GemmKNColumnsPaired(const uint16_t* x, int64_t m_dim, int64_t k_dim,
                                const uint16_t* wp, int64_t n, int64_t n0, float* out) {
  constexpr int kMR = 6;
  int64_t m0 = 0;
  for (; m0 + kMR <= m_dim; m0 += kMR) GemmKNTilePaired<kMR>(x, k_dim, m0, wp, n, n0, out);
  switch (m_dim - m0) {
    case 1: GemmKNTilePaired<1>(x, k_dim, m0, wp, n, n0, out); break;
    case 2: GemmKNTilePaired<2>(x, k_dim, m0, wp, n, n0, out); break;
    case 3: GemmKNTilePaired<3>(x, k_dim, m0, wp, n, n0, out); break;
    case 4: GemmKNTilePaired<4>(x, k_dim, m0, wp, n, n0, out); break;
    case 5: GemmKNTilePaired<5>(x, k_dim, m0, wp, n, n0, out); break;
    default: break;
  }
}

constexpr int64_t kNKBlock = 64;  // vocabulary rows per work item of the [N, K] matmul

// NJ (4 or 8) vocabulary rows (n0..n0 + NJ) x MR <= 6 x rows: NJ MR accumulators of 32-dim
// products. Row m's NJ logits go to out + m * kNKBlock (out: the tile's place in its row tile's
// [MR, kNKBlock] scratch, GemmNKRowTile).
template <int MR, int NJ = 4>
inline void GemmNKTile(const uint16_t* x, int64_t k_dim, int64_t m0, const uint16_t* w,
                       int64_t n, int64_t n0, float* out) {
  static_assert(MR >= 1 && MR * NJ <= 24 && NJ % 4 == 0, "at most 24 accumulators");
  __m512 acc[MR][NJ];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NJ; ++j) acc[m][j] = _mm512_setzero_ps();
  // The first row tile of a block streams its vocabulary rows from memory: with 3 or more
  // rows (enough arithmetic to hide the loads behind) it fetches the rows kNKPrefetch tiles
  // ahead itself, one cache line each per step. Measured at 5 / 10 / 16 rows: 2.4-2.9 /
  // 3.5-4.1 / 4.5-4.8 ms against 3.4-3.6 / 4.3-4.4 / 5.3-5.7 ms without; at 1-2 rows (memory
  // bound) it cost ~10%, so they do without.
  const bool prefetch = MR >= 3 && m0 == 0 && n0 + 4 * kNKPrefetch + 4 <= n;
  for (int64_t k0 = 0; k0 < k_dim; k0 += 32) {
    __m512i wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = _mm512_loadu_si512(w + (n0 + j) * k_dim + k0);
    if (prefetch) PrefetchNKTile(w, n0 + 4 * kNKPrefetch, k_dim, k0);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * k_dim + k0);
      for (int j = 0; j < NJ; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, (__m512bh)wv[j]);
    }
  }
  // One transposing tree per 4 x rows: a[4 j + m] (vocabulary row j, x row m) lands in lane
  // 4 m + j, so x row m's four logits are one 16-byte store. Missing x rows are zero
  // accumulators; each sum stays in its own lanes, so a row's logits never depend on MR.
  for (int jg = 0; jg < NJ; jg += 4) {
    for (int g = 0; g < MR; g += 4) {
      __m512 a[16];
      for (int j = 0; j < 4; ++j)
        for (int m = 0; m < 4; ++m)
          a[4 * j + m] = g + m < MR ? acc[g + m][jg + j] : _mm512_setzero_ps();
      const __m512 sums = TreeSum16(a);
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, sums);
      for (int m = 0; m < 4 && g + m < MR; ++m)
        std::memcpy(out + (g + m) * kNKBlock + jg, lanes + 4 * m, 16);
    }
  }
}

// Rows m0.. m0 + mr (1 <= mr <= 6) of a column block, one tile shape for the whole block.
// The tiles write a small row-major scratch ([mr, 64]), copied to out by whole rows at the
// end: out's rows are N floats apart (196,608 bytes for SmolLM2's 49,152-entry vocabulary, a
// multiple of 64 KiB), so 16-byte stores straight into them all map to one cache set. x @ E^T
// at V = 49,152 on the Zen 4 (old and new builds alternated twice, fastest of 15 calls):
// 256 rows 68.2-68.5 -> 65.4-65.6 ms, 32 rows 6.6-6.7 -> 6.2-6.5, 10 rows 3.3-3.8 -> 3.2-3.4,
// 1-5 rows unchanged. Streaming (non-temporal) row stores were no faster. The rest of the gap
// to V = 6,144 (318 GFLOP/s at 256 rows against ~220 here) is page faults, not this kernel:
// glibc maps the 50 MB output afresh on every call, and the tiles' first stores fault it in.
// With the heap settings of llmserve/host_memory.py given at process start, the same calls
// take 37.8-38.1 ms against 63.7-63.8 ms (~380 GFLOP/s; 32 rows unchanged at 6.2 ms).

inline void GemmNKRowTile(const uint16_t* x, int64_t mr, int64_t k_dim, int64_t m0,
                          const uint16_t* w, int64_t n, int64_t n0, int64_t n1, float* out) {
  alignas(64) float tile[6 * kNKBlock];
  int64_t j = n0;
  // One or two x rows (batch-1/2 decode) take 8 vocabulary rows a tile: 8-16 dot chains in
  // flight instead of 4-8, each row's chain and tree unchanged (bitwise the 4-row tiles). x @ E^T
  // at V = 49,152, one row, 10 chained calls, builds alternated seven times: median 2.1-3.2 ->
  // 1.8-2.7 ms a call (lower in 6 of 7 pairs).
  if (mr <= 2) {
    for (; j + 8 <= n1; j += 8) {
      float* t = tile + (j - n0);
      if (mr == 1) GemmNKTile<1, 8>(x, k_dim, m0, w, n, j, t);
      else GemmNKTile<2, 8>(x, k_dim, m0, w, n, j, t);
    }
  }
  for (; j < n1; j += 4) {
    float* t = tile + (j - n0);
    switch (mr) {
      case 1: GemmNKTile<1>(x, k_dim, m0, w, n, j, t); break;
      case 2: GemmNKTile<2>(x, k_dim, m0, w, n, j, t); break;
      case 3: GemmNKTile<3>(x, k_dim, m0, w, n, j, t); break;
      case 4: GemmNKTile<4>(x, k_dim, m0, w, n, j, t); break;
      case 5: GemmNKTile<5>(x, k_dim, m0, w, n, j, t); break;
      default: GemmNKTile<6>(x, k_dim, m0, w, n, j, t); break;
    }
  }
  for (int64_t m = 0; m < mr; ++m)
    std::memcpy(out + (m0 + m) * n + n0, tile + m * kNKBlock, (n1 - n0) * sizeof(float));
}

// Up to kNKBalancedMaxRows rows (a verify step's 1 + R tokens for 1-2 sequences) go in
// ceil(M / 6) tiles of balanced height (5 -> 5, 7 -> 4 + 3, 10 -> 5 + 5, 12 -> 6 + 6) instead of
// 4-row tiles and a short rest (10 -> 4 + 4 + 2): every pass over the block's weights serves
// nearly 6 rows. More rows keep the 4-row tiles (one tree per 4 rows).
constexpr int64_t kNKBalancedMaxRows = 12;

inline void GemmNKRows(const uint16_t* x, int64_t m_dim, int64_t k_dim, const uint16_t* w,
                       int64_t n, int64_t n0, int64_t n1, float* out) {
  if (m_dim <= kNKBalancedMaxRows) {
    const int64_t tiles = (m_dim + 5) / 6;
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t mr = (m_dim - m0) / (tiles - t);  // the later tiles take the remainder
      GemmNKRowTile(x, mr, k_dim, m0, w, n, n0, n1, out);
      m0 += mr;
    }
    return;
  }
  int64_t m0 = 0;
  for (; m0 + 4 <= m_dim; m0 += 4) GemmNKRowTile(x, 4, k_dim, m0, w, n, n0, n1, out);
  if (m0 < m_dim) GemmNKRowTile(x, m_dim - m0, k_dim, m0, w, n, n0, n1, out);
}

// ---- AMX (Intel's tile matrix unit): the bf16 matmuls on CPUs that have it ----
//
// Why: on a 2-core AMX Xeon the AVX512_BF16 kernels above are compute-bound from a few rows up
// (SmolLM2's weight matmuls, experiments/matmul.py: 13.1 ms at one row, 24.8 at 8, 37.5 at 16,
// 65.3 at 32), while one tile multiply (TDPBF16PS: 16 x 16 outputs, 32 dims) does 16x the work
// of a vdpbf16ps. Tiles: C 16 x 16 float32 (tmm0-3, one per 16 output columns), A up to 16 rows
// x 32 bf16 dims (tmm4, or tmm5-7), B 16 dim pairs x 16 columns of bf16 pairs (the "VNNI"
// layout: rows k and k + 1 interleaved).
//   w paired [N / 64, K / 2, 128] (what Runner gives bf16 weights here): x rows are A and the
//     weights B, both read in place. The same weights through the tiles: 15.6 ms at one row, 14.7
//     at 8, 19.0 at 16, 24.4 at 32, 27.0 at 64.
//   w [K, N] or blocked: as paired, but each dim step is interleaved into B tiles first (one
//     permute per 16 columns, into a thread's scratch): slower at one row than the AVX512_BF16
//     kernel (the interleave and the tiles do not overlap well), faster from a few rows.
//   w [N, K] (the tied vocabulary projection): the vocabulary rows are A, read in place (16
//     rows at a stride of K), and x is B, interleaved once per call; a C tile is 16 vocabulary
//     rows x 16 x rows, written out transposed.
// A row block of fewer than 16 rows is configured as such (tile rows), so no tile reads past x or
// writes past out. Every output is one tile chain over the dims in a fixed order that does not
// depend on the other rows or on the row block it lands in: batch invariant, like the kernels
// above (not bitwise equal to them: the tiles add each pair's two products before adding them
// to the sum, vdpbf16ps adds them one at a time). The choice of AMX depends only on the CPU and
// the shapes, never on the row count, so a verify row still equals a decode row.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLMSERVE_AMX 1

// Linux hands out the tile state to a process only on request (arch_prctl, kernel >= 5.16).
bool AmxPermitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 64 bytes wide; C (tmm0-3) and A (tmm4) `rows` rows, tmm5-7 16 (a row block of
// fewer than 16 x rows loads and stores only its rows: no padding copy, no scratch). Loaded by
// each work item (another library on this thread, oneDNN inside XLA, may have loaded its own),
// which releases the tiles at its end.
inline void AmxConfigure(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t <= 4 ? rows : 16);
  }
  _tile_loadconfig(&c);
}

// C tile t (0-3) -> dst, rows `stride` bytes apart (the tile intrinsics take literal tiles).
inline void AmxStoreTile(int t, float* dst, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, dst, stride); break;
    case 1: _tile_stored(1, dst, stride); break;
    case 2: _tile_stored(2, dst, stride); break;
    default: _tile_stored(3, dst, stride); break;
  }
}

// Dim step s of the column block wb (rows 32 s .. 32 s + 32 of `groups` x 16 columns, ldw
// apart) -> its B tiles at b: tile g is 16 dim pairs x 32 bf16 at b + g * 512 (rows k and
// k + 1 as pairs: one permute per 16 columns, the vdpbf16ps kernels' unpack).
inline void AmxPackStep(const uint16_t* wb, int64_t ldw, int64_t s, int64_t groups, uint16_t* b) {
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  for (int64_t p = 0; p < 16; ++p) {
    const uint16_t* r0 = wb + (32 * s + 2 * p) * ldw;
    for (int64_t h = 0; 2 * h < groups; ++h) {
      const __m512i va = _mm512_loadu_si512(r0 + 32 * h);
      const __m512i vb = _mm512_loadu_si512(r0 + ldw + 32 * h);
      uint16_t* t = b + (2 * h * 16 + p) * 32;
      _mm512_storeu_si512(t, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(t + 512, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// C[0 .. groups) += A (tmm4, loaded from a) @ B tiles g = 0 .. groups - 1 at b + g * off, rows
// ldb bytes apart (AmxPackStep's scratch: off 512, ldb 64; the paired layout: off 32, ldb 256).
LLMSERVE_INLINE void AmxStep(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t off,
                             int64_t ldb, int64_t groups) {
  _tile_loadd(4, a, lda);
  _tile_loadd(5, b, ldb);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, b + off, ldb);
  _tile_dpbf16ps(1, 4, 6);
  if (groups == 4) {
    _tile_loadd(7, b + 2 * off, ldb);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 3 * off, ldb);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// Every 16-row block of x [m_dim, K] (K % 32 == 0) through the dim steps s, whose B tiles
// b_step(s) returns (AmxStep's off, ldb) -> out columns [n0, n0 + 16 groups) of rows [0, m_dim)
// (out [., n] float32). A block of fewer rows is configured as such (AmxConfigure).
template <typename F>
LLMSERVE_INLINE void AmxRowBlocks(const uint16_t* x, int64_t m_dim, int64_t k_dim, int64_t n,
                                  int64_t n0, int64_t groups, int64_t off, int64_t ldb,
                                  float* out, F&& b_step) {
  const int64_t steps = k_dim / 32;
  const int64_t lda = k_dim * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t ldo = n * static_cast<int64_t>(sizeof(float));
  int64_t configured = -1;
  for (int64_t m0 = 0; m0 < m_dim; m0 += 16) {
    const int64_t mr = std::min<int64_t>(16, m_dim - m0);
    if (mr != configured) AmxConfigure(configured = mr);
    const uint16_t* a = x + m0 * k_dim;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) AmxStep(a + 32 * s, lda, b_step(s), off, ldb, groups);
    float* o = out + m0 * n + n0;
    _tile_stored(0, o, ldo);
    _tile_stored(1, o + 16, ldo);
    if (groups == 4) {
      _tile_stored(2, o + 32, ldo);
      _tile_stored(3, o + 48, ldo);
    }
  }
}

// x [m_dim, K] @ the column block wb (rows of `cols` = 32 or 64 columns, ldw apart) -> out
// columns [n0, n0 + cols) of rows [0, m_dim) (out [., n] float32). K % 32 == 0. Configures the
// tiles itself. Up to 16 rows (a decode or verify step) pack each dim step just before its
// tiles use it, into a ring of kRing slots in L1 (so the weight stream never waits for the
// tiles: a whole block packed first ran SmolLM2's 1-row layer matmuls at half the AVX512_BF16
// kernel's speed); more rows pack the whole block once (in L2) and run every 16-row block over
// it. Both run the same tiles in the same order.
inline void AmxKNColumns(const uint16_t* x, int64_t m_dim, int64_t k_dim, const uint16_t* wb,
                         int64_t ldw, int64_t n, int64_t n0, int64_t cols, float* out) {
  constexpr int64_t kRing = 4, kAhead = 2;
  thread_local std::vector<uint16_t> vnni;
  const int64_t steps = k_dim / 32, groups = cols / 16, tile = groups * 512;
  const bool one_block = m_dim <= 16;
  vnni.resize(static_cast<size_t>((one_block ? kRing : steps) * tile));
  uint16_t* b = vnni.data();
  for (int64_t s = 0; s < (one_block ? std::min(kAhead, steps) : steps); ++s)
    AmxPackStep(wb, ldw, s, groups, b + s * tile);
  AmxRowBlocks(x, m_dim, k_dim, n, n0, groups, 512, 64, out, [&](int64_t s) {
    if (!one_block) return b + s * tile;
    if (s + kAhead < steps)
      AmxPackStep(wb, ldw, s + kAhead, groups, b + ((s + kAhead) % kRing) * tile);
    return b + (s % kRing) * tile;
  });
}

// x [m_dim, K] @ the paired layout's 64-column block wp (K / 2 rows of 128 bf16) -> out columns
// [n0, n0 + 64) of rows [0, m_dim): B tile (s, g) is read in place, 16 pair rows of 64 bytes at
// a stride of 256, so nothing is packed. Configures the tiles itself.
inline void AmxKNPaired(const uint16_t* x, int64_t m_dim, int64_t k_dim, const uint16_t* wp,
                        int64_t n, int64_t n0, float* out) {
  constexpr int64_t ldb = kPairedWidth * static_cast<int64_t>(sizeof(uint16_t));
  AmxRowBlocks(x, m_dim, k_dim, n, n0, 4, 32, ldb, out,
               [=](int64_t s) { return wp + 16 * s * kPairedWidth; });
}

// x [m_dim, K] -> B tiles xv: row block mb's dim step s is 16 dim pairs x 16 rows of bf16
// pairs at xv + (mb * steps + s) * 512 (rows past m_dim: zeros).
inline void AmxPackX(const uint16_t* x, int64_t m_dim, int64_t k_dim, uint16_t* xv) {
  const int64_t steps = k_dim / 32, blocks = (m_dim + 15) / 16, pairs = k_dim / 2;
  const uint32_t* x2 = reinterpret_cast<const uint32_t*>(x);
  uint32_t* v2 = reinterpret_cast<uint32_t*>(xv);
  for (int64_t mb = 0; mb < blocks; ++mb)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t m = 0; m < 16; ++m) {
          const int64_t row = 16 * mb + m;
          v2[((mb * steps + s) * 16 + p) * 16 + m] = row < m_dim ? x2[row * pairs + 16 * s + p] : 0;
        }
}

// out[:m_dim, n0 .. n1) = x @ w[n0 .. n1)^T for w [N, K] (n1 - n0 a multiple of 16, <= 64), x
// already packed by AmxPackX.
inline void AmxNKRows(const uint16_t* xv, int64_t m_dim, int64_t k_dim, const uint16_t* w,
                      int64_t n, int64_t n0, int64_t n1, float* out) {
  alignas(64) float cbuf[256];
  const int64_t steps = k_dim / 32, groups = (n1 - n0) / 16;
  const int64_t lda = k_dim * static_cast<int64_t>(sizeof(uint16_t));
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(16),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15));
  auto store = [&](int64_t m0, int64_t j) {  // cbuf: vocabulary rows n0 + 16 j .. x 16 x rows
    const int64_t mr = std::min<int64_t>(16, m_dim - m0);
    for (int64_t m = 0; m < mr; ++m) {
      const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(
                                               static_cast<int>(m))), cbuf, 4);
      _mm512_storeu_ps(out + (m0 + m) * n + n0 + 16 * j, v);
    }
  };
  AmxConfigure(16);
  for (int64_t mb = 0, m0 = 0; m0 < m_dim; ++mb, m0 += 16) {
    const uint16_t* bx = xv + mb * steps * 512;
    const uint16_t* a = w + n0 * k_dim;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* as = a + 32 * s;
      _tile_loadd(4, bx + s * 512, 64);
      _tile_loadd(5, as, lda);
      _tile_dpbf16ps(0, 5, 4);
      if (groups > 1) {
        _tile_loadd(6, as + 16 * k_dim, lda);
        _tile_dpbf16ps(1, 6, 4);
      }
      if (groups > 2) {
        _tile_loadd(7, as + 32 * k_dim, lda);
        _tile_dpbf16ps(2, 7, 4);
      }
      if (groups > 3) {
        _tile_loadd(5, as + 48 * k_dim, lda);
        _tile_dpbf16ps(3, 5, 4);
      }
    }
    for (int64_t j = 0; j < groups; ++j) {
      AmxStoreTile(static_cast<int>(j), cbuf, 64);
      store(m0, j);
    }
  }
}
#endif  // __AMX_TILE__ && __AMX_BF16__

#endif  // __AVX512BF16__

// 1: the bf16 matmuls use AMX where this build and the CPU have it; 0: the AVX512_BF16 kernels
// only (LlmserveAmxMatmul sets it: tests and benchmarks compare the two in one process).
std::atomic<int> g_amx_matmul{1};

inline bool UseAmx() {
#if defined(LLMSERVE_AMX)
  return g_amx_matmul.load(std::memory_order_relaxed) != 0 && AmxPermitted();
#else
  return false;
#endif
}

// ---- AVX2 + FMA matmuls (CPUs without AVX-512): x [M, K] @ w -> out [M, N] float32 ----
//
// Why: on a 2-core AMD EPYC (Zen 3, AVX2, no AVX-512) XLA:CPU's dots run SmolLM2's decode-step
// matmuls well below the memory roof at 1-32 rows (experiments/matmul.py). One template serves
// float32 and bf16 weights: a bf16 weight vector is widened to float32 in registers (a zero
// extend and a 16-bit shift: exact), so bf16 weights stream half the bytes of float32 ones and
// every product is the exact float32 product. x arrives in the weight's dtype; bf16 x rows are
// widened once per call into a float32 scratch. Same tiling as the AVX-512 kernels, 8 lanes:
//   w [K, N]: 6 rows x 16 columns of accumulators (12 ymm + 2 weights + 1 broadcast), one
//     broadcast x element times two 8-column weight vectors per k; one or two x rows instead
//     stream 96-column blocks row by row (one contiguous weight run per k);
//   w [N, K] (the tied vocabulary projection): 2 x rows x 4 vocabulary rows, 8 dims per step,
//     summed horizontally at the end.
// Accumulation is float32 in k order (per lane); every row is independent of the others.
#if defined(LLMSERVE_AVX2_MATMUL)
// GCC left the accumulator arrays below in memory as well as in registers (a store of every
// accumulator on every k: half the FMA rate at 32 rows); fully unrolled loops keep them in
// registers only (SmolLM2's fp32 layer matmuls at 32 rows: 141 -> 83 ms in a C++ harness).
#define LLMSERVE_UNROLL _Pragma("GCC unroll 16")

inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {  // 8 bf16 -> float32 (exact)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Weight rows this far ahead are prefetched by the first row tile of a block: consecutive k
// rows are n elements apart, on other 4 KiB pages, where the hardware prefetchers stop.
constexpr int64_t kAvx2PrefetchRows = 8;
// Up to this many x rows, each row streams a whole column block on its own (below).
constexpr int64_t kAvx2RowBlockMaxRows = 2;
// Columns per work item in that case: wider runs of contiguous weights per k than 64, yet
// enough items for two threads on SmolLM2's 576-column weights (6 items).
constexpr int64_t kAvx2RowBlockCols = 96;

template <int MR, typename WT>
inline void GemmKNTile8(const float* x, int64_t k_dim, int64_t m0, const WT* w, int64_t n,
                        int64_t n0, float* out) {
  constexpr int kNV = 2;
  __m256 acc[MR][kNV];
  LLMSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    LLMSERVE_UNROLL
    for (int v = 0; v < kNV; ++v) acc[m][v] = _mm256_setzero_ps();
  }
  const float* xr = x + m0 * k_dim;
  for (int64_t k = 0; k < k_dim; ++k) {
    const WT* wr = w + k * n + n0;
    if (m0 == 0 && k + kAvx2PrefetchRows < k_dim) {
      const char* p = reinterpret_cast<const char*>(wr + kAvx2PrefetchRows * n);
      if (MR < 6 && n0 % 64 == 0) {
        // The block's only row tile (3-5 rows): fetch the whole 64-column row for the strips
        // that follow, so memory sees one contiguous run per k instead of four.
        for (int b = 0; b < static_cast<int>(64 * sizeof(WT)); b += 64) {
          _mm_prefetch(p + b, _MM_HINT_T0);
        }
      } else if (MR == 6) {
        _mm_prefetch(p, _MM_HINT_T0);
      }
    }
    __m256 wv[kNV];
    LLMSERVE_UNROLL
    for (int v = 0; v < kNV; ++v) wv[v] = Load8(wr + 8 * v);
    LLMSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(xr + m * k_dim + k);
      LLMSERVE_UNROLL
      for (int v = 0; v < kNV; ++v) acc[m][v] = _mm256_fmadd_ps(a, wv[v], acc[m][v]);
    }
  }
  LLMSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    LLMSERVE_UNROLL
    for (int v = 0; v < kNV; ++v) _mm256_storeu_ps(out + (m0 + m) * n + n0 + 8 * v, acc[m][v]);
  }
}

// x row m times columns [n0, n1) of w [K, N] (at most 256): the weights of each k are one
// contiguous run and the accumulators live in L1. Each output is the same k-ordered chain of
// FMAs as in GemmKNTile8, so a row's result does not depend on which path served it.
template <typename WT>
inline void GemmKNRowBlock8(const float* x, int64_t k_dim, int64_t m, const WT* w, int64_t n,
                            int64_t n0, int64_t n1, float* out) {
  alignas(64) float acc[256];
  const int64_t width = n1 - n0;
  for (int64_t j = 0; j < width; ++j) acc[j] = 0.0f;
  const float* xr = x + m * k_dim;
  for (int64_t k = 0; k < k_dim; ++k) {
    const WT* wr = w + k * n + n0;
    if (m == 0 && k + kAvx2PrefetchRows < k_dim) {
      const char* p = reinterpret_cast<const char*>(wr + kAvx2PrefetchRows * n);
      for (int64_t b = 0; b < static_cast<int64_t>(width * sizeof(WT)); b += 64) {
        _mm_prefetch(p + b, _MM_HINT_T0);
      }
    }
    const __m256 a = _mm256_broadcast_ss(xr + k);
    for (int64_t j = 0; j < width; j += 8) {
      _mm256_store_ps(acc + j, _mm256_fmadd_ps(a, Load8(wr + j), _mm256_load_ps(acc + j)));
    }
  }
  for (int64_t j = 0; j < width; ++j) out[m * n + n0 + j] = acc[j];
}

// Columns n0..n1 (a multiple of 16) of every x row; each 16-column strip of weights stays in
// cache while all row tiles pass over it. One or two rows stream the block row by row instead.
template <typename WT>
inline void GemmKNColumns8(const float* x, int64_t m_dim, int64_t k_dim, const WT* w, int64_t n,
                           int64_t n0, int64_t n1, float* out) {
  if (m_dim <= kAvx2RowBlockMaxRows) {
    for (int64_t m = 0; m < m_dim; ++m) GemmKNRowBlock8<WT>(x, k_dim, m, w, n, n0, n1, out);
    return;
  }
  constexpr int kMR = 6;
  for (int64_t c = n0; c < n1; c += 16) {
    int64_t m0 = 0;
    for (; m0 + kMR <= m_dim; m0 += kMR) GemmKNTile8<kMR, WT>(x, k_dim, m0, w, n, c, out);
    switch (m_dim - m0) {
      case 1: GemmKNTile8<1, WT>(x, k_dim, m0, w, n, c, out); break;
      case 2: GemmKNTile8<2, WT>(x, k_dim, m0, w, n, c, out); break;
      case 3: GemmKNTile8<3, WT>(x, k_dim, m0, w, n, c, out); break;
      case 4: GemmKNTile8<4, WT>(x, k_dim, m0, w, n, c, out); break;
      case 5: GemmKNTile8<5, WT>(x, k_dim, m0, w, n, c, out); break;
      default: break;
    }
  }
}

// The four lane sums of a, b, c, d as one 4-float vector.
inline __m128 Sum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

template <int MR, typename WT>
inline void GemmNKTile8(const float* x, int64_t k_dim, int64_t m0, const WT* w, int64_t n,
                        int64_t n0, float* out) {
  __m256 acc[MR][4];
  LLMSERVE_UNROLL
  for (int m = 0; m < MR; ++m) {
    LLMSERVE_UNROLL
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < k_dim; k0 += 8) {
    __m256 wv[4];
    LLMSERVE_UNROLL
    for (int j = 0; j < 4; ++j) wv[j] = Load8(w + (n0 + j) * k_dim + k0);
    LLMSERVE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + m) * k_dim + k0);
      LLMSERVE_UNROLL
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  LLMSERVE_UNROLL
  for (int m = 0; m < MR; ++m)
    _mm_storeu_ps(out + (m0 + m) * n + n0, Sum4x8(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <typename WT>
inline void GemmNKRows8(const float* x, int64_t m_dim, int64_t k_dim, const WT* w, int64_t n,
                        int64_t n0, int64_t n1, float* out) {
  int64_t m0 = 0;
  for (; m0 + 2 <= m_dim; m0 += 2)
    for (int64_t j = n0; j < n1; j += 4) GemmNKTile8<2, WT>(x, k_dim, m0, w, n, j, out);
  if (m0 < m_dim)
    for (int64_t j = n0; j < n1; j += 4) GemmNKTile8<1, WT>(x, k_dim, m0, w, n, j, out);
}

// out = x @ w for float32 x [M, K] (already widened) and WT weights; the shapes are checked.
template <typename WT>
void MatmulAvx2(ffi::ThreadPool& pool, const float* xp, int64_t m_dim, int64_t k_dim,
                const WT* wp, int64_t n, bool transpose_w, float* op) {
  const bool row_blocks = !transpose_w && m_dim <= kAvx2RowBlockMaxRows &&
                          n % kAvx2RowBlockCols == 0 && n / kAvx2RowBlockCols >= 2;
  const int64_t block = row_blocks ? kAvx2RowBlockCols : 64;  // columns per work item
  const int64_t items = (n + block - 1) / block;
  const int64_t min_items = MatmulMinItems(m_dim, k_dim, block);
  ParallelFor(pool, items, min_items, [=](int64_t item) {
    const int64_t n0 = item * block, n1 = std::min(n, n0 + block);
    if (transpose_w) {
      GemmNKRows8<WT>(xp, m_dim, k_dim, wp, n, n0, n1, op);
    } else {
      GemmKNColumns8<WT>(xp, m_dim, k_dim, wp, n, n0, n1, op);
    }
  });
}
#endif  // LLMSERVE_AVX2_MATMUL

// x [M, K] bf16, w [K, N] (transpose_w = false) or [N, K] (true) bf16 -> out [M, N] float32.
// Shapes: K % 32 == 0; N % 32 == 0 ([K, N]) or N % 4 == 0 ([N, K]). The Python side checks them
// (and LlmserveHasBf16Matmul) before it calls.
ffi::Error MatmulBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Buffer<ffi::S32> live, bool transpose_w,
                          ffi::Result<ffi::Buffer<ffi::F32>> out) {
#if defined(__AVX512BF16__) || defined(LLMSERVE_AVX2_MATMUL)
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("x and w must be bf16");
  }
  int64_t rows, k_dim, n;
  bool blocked, paired;
  if (ffi::Error e = MatmulDims(xd, wd, transpose_w, 32, 32, &rows, &k_dim, &n, &blocked,
                                &paired);
      e.failure()) {
    return e;
  }
  if (rows == 0 || n == 0) return ffi::Error::Success();
  float* op = out->typed_data();
  const int64_t m_dim = LiveRows(live, rows);  // rows [m_dim, rows): padding, zeros
#if defined(__AVX512BF16__)
  const uint16_t* xp = static_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* wp = static_cast<const uint16_t*>(w.untyped_data());
  constexpr int64_t kBlock = kNKBlock;  // columns per work item (both layouts)
  static_assert(kBlock == kBlockedColumns, "a work item is one block of the blocked layout");
#if defined(LLMSERVE_AMX)
  if (UseAmx() && (!transpose_w || n % 16 == 0)) {  // items: whole column blocks, every row
    std::vector<uint16_t> xv;
    if (transpose_w) {
      xv.resize(static_cast<size_t>((m_dim + 15) / 16 * 16 * k_dim));
      AmxPackX(xp, m_dim, k_dim, xv.data());
    }
    const uint16_t* xvp = xv.data();
    ParallelFor(pool, (n + kBlock - 1) / kBlock, MatmulMinItems(m_dim, k_dim, kBlock),
                [=](int64_t item) {
      const int64_t n0 = item * kBlock, n1 = std::min(n, n0 + kBlock);
      ZeroPaddingRows(op, m_dim, rows, n, n0, n1);
      if (m_dim == 0) return;
      if (transpose_w) {
        AmxNKRows(xvp, m_dim, k_dim, wp, n, n0, n1, op);
      } else if (paired) {
        AmxKNPaired(xp, m_dim, k_dim, wp + item * k_dim * kBlockedColumns, n, n0, op);
      } else {
        int64_t ldw;
        const uint16_t* wb = KNBlock(wp, blocked, k_dim, n, n0, &ldw);
        AmxKNColumns(xp, m_dim, k_dim, wb, ldw, n, n0, n1 - n0, op);
      }
      _tile_release();
    });
    return ffi::Error::Success();
  }
#endif
  ForEachMatmulItem(pool, xp, m_dim, rows, k_dim, n, kBlock, op,
                    [=](const uint16_t* xr, int64_t mr, float* orow, int64_t n0, int64_t n1) {
    if (transpose_w) {
      GemmNKRows(xr, mr, k_dim, wp, n, n0, n1, orow);
      return;
    }
    if (paired) {
      GemmKNColumnsPaired(xr, mr, k_dim, wp + (n0 / kBlock) * k_dim * kBlock, n, n0, orow);
      return;
    }
    int64_t ldw;
    const uint16_t* wb = KNBlock(wp, blocked, k_dim, n, n0, &ldw);
    if (n1 - n0 == 64) {
      GemmKNColumns<2>(xr, mr, k_dim, wb, ldw, n, n0, orow);
    } else {
      GemmKNColumns<1>(xr, mr, k_dim, wb, ldw, n, n0, orow);
    }
  });
#else
  if (blocked) return ffi::Error::InvalidArgument("blocked weights need the AVX-512 kernels");
  // x is small ([M, K]): widen it once here instead of once per column block.
  const uint16_t* xh = static_cast<const uint16_t*>(x.untyped_data());
  std::vector<float> xf(static_cast<size_t>(m_dim * k_dim));
  for (int64_t i = 0; i < m_dim * k_dim; ++i) xf[i] = Bf16ToF32(xh[i]);
  MatmulAvx2<uint16_t>(pool, xf.data(), m_dim, k_dim, static_cast<const uint16_t*>(w.untyped_data()),
                       n, transpose_w, op);
  ZeroPaddingRows(op, m_dim, rows, n, 0, n);
#endif
  return ffi::Error::Success();
#else
  (void)pool; (void)x; (void)w; (void)live; (void)transpose_w; (void)out;
  return ffi::Error::InvalidArgument("this build has no bf16 matmul (AVX512_BF16 or AVX2)");
#endif
}


// ---- float32 matmul (AVX-512): x [M, K] f32 @ w -> out [M, N] f32, the same tiling as bf16 ----
// w [K, N]: 6 rows x 64 columns of accumulators, one broadcast x element times four 16-column
// weight vectors per k (no pairing needed); w [N, K]: 4 x 4 tiles, 16 dims per step, summed by
// TreeSum16. Accumulation is float32 in k order; each row independent of the others.
#if defined(__AVX512F__)
template <int MR, int NV>
inline void GemmKNTileF32(const float* x, int64_t k_dim, int64_t m0, const float* wb,
                          int64_t ldw, int64_t n, int64_t n0, float* out) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const float* xr = x + m0 * k_dim;
  constexpr int64_t kPrefetch = 16;  // rows ahead ([K, N]: each row of the block on another page)
  // (blocked, contiguous rows: the hardware's prefetch alone for 3+ rows, as in GemmKNTile)
  const bool prefetch = m0 == 0 && (ldw != kBlockedColumns || MR < 3);
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* wr = wb + k * ldw;
    if (prefetch && k + kPrefetch < k_dim) {
      const char* p = reinterpret_cast<const char*>(wr + kPrefetch * ldw);
      for (int v = 0; v < NV; ++v) _mm_prefetch(p + 64 * v, _MM_HINT_T0);
    }
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_ps(wr + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(xr[m * k_dim + k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(a, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (m0 + m) * n + n0 + 16 * v, acc[m][v]);
}

template <int NV>
inline void GemmKNColumnsF32(const float* x, int64_t m_dim, int64_t k_dim, const float* wb,
                             int64_t ldw, int64_t n, int64_t n0, float* out) {
  constexpr int kMR = 6;
  int64_t m0 = 0;
  for (; m0 + kMR <= m_dim; m0 += kMR)
    GemmKNTileF32<kMR, NV>(x, k_dim, m0, wb, ldw, n, n0, out);
  switch (m_dim - m0) {
    case 1: GemmKNTileF32<1, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 2: GemmKNTileF32<2, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 3: GemmKNTileF32<3, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 4: GemmKNTileF32<4, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    case 5: GemmKNTileF32<5, NV>(x, k_dim, m0, wb, ldw, n, n0, out); break;
    default: break;
  }
}

template <int MR>
inline void GemmNKTileF32(const float* x, int64_t k_dim, int64_t m0, const float* w, int64_t n,
                          int64_t n0, float* out) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const bool prefetch = MR >= 3 && m0 == 0 && n0 + 4 * kNKPrefetch + 4 <= n;  // as GemmNKTile
  for (int64_t k0 = 0; k0 < k_dim; k0 += 16) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + (n0 + j) * k_dim + k0);
    if (prefetch) PrefetchNKTile(w, n0 + 4 * kNKPrefetch, k_dim, k0);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + m) * k_dim + k0);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  __m512 a[16];
  for (int j = 0; j < 4; ++j)
    for (int m = 0; m < 4; ++m) a[4 * j + m] = m < MR ? acc[m][j] : _mm512_setzero_ps();
  const __m512 sums = TreeSum16(a);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sums);
  for (int m = 0; m < MR; ++m) std::memcpy(out + (m0 + m) * n + n0, lanes + 4 * m, 16);
}

inline void GemmNKRowsF32(const float* x, int64_t m_dim, int64_t k_dim, const float* w,
                          int64_t n, int64_t n0, int64_t n1, float* out) {
  constexpr int kMR = 4;
  int64_t m0 = 0;
  for (; m0 + kMR <= m_dim; m0 += kMR)
    for (int64_t j = n0; j < n1; j += 4) GemmNKTileF32<kMR>(x, k_dim, m0, w, n, j, out);
  const int64_t rest = m_dim - m0;
  for (int64_t j = n0; j < n1; j += 4) {
    switch (rest) {
      case 1: GemmNKTileF32<1>(x, k_dim, m0, w, n, j, out); break;
      case 2: GemmNKTileF32<2>(x, k_dim, m0, w, n, j, out); break;
      case 3: GemmNKTileF32<3>(x, k_dim, m0, w, n, j, out); break;
      default: break;
    }
  }
}
#endif  // __AVX512F__

// x [M, K] f32, w [K, N] (transpose_w = false), [N, K] (true) or blocked [N / 64, K, 64] f32
// -> out [M, N] f32.
// Shapes: K % 16 == 0; N % 16 == 0 ([K, N]) or N % 4 == 0 ([N, K]); checked in Python too.
ffi::Error MatmulF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> live, bool transpose_w,
                         ffi::Result<ffi::Buffer<ffi::F32>> out) {
#if defined(__AVX512F__) || defined(LLMSERVE_AVX2_MATMUL)
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  int64_t rows, k_dim, n;
  bool blocked;
  if (ffi::Error e = MatmulDims(xd, wd, transpose_w, 16, 16, &rows, &k_dim, &n, &blocked);
      e.failure()) {
    return e;
  }
  if (rows == 0 || n == 0) return ffi::Error::Success();
  float* op = out->typed_data();
  const int64_t m_dim = LiveRows(live, rows);  // rows [m_dim, rows): padding, zeros
#if defined(__AVX512F__)
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  constexpr int64_t kBlock = 64;
  static_assert(kBlock == kBlockedColumns, "a work item is one block of the blocked layout");
  ForEachMatmulItem(pool, xp, m_dim, rows, k_dim, n, kBlock, op,
                    [=](const float* xr, int64_t mr, float* orow, int64_t n0, int64_t n1) {
    if (transpose_w) {
      GemmNKRowsF32(xr, mr, k_dim, wp, n, n0, n1, orow);
      return;
    }
    int64_t ldw;
    const float* wb = KNBlock(wp, blocked, k_dim, n, n0, &ldw);
    switch ((n1 - n0) / 16) {
      case 4: GemmKNColumnsF32<4>(xr, mr, k_dim, wb, ldw, n, n0, orow); break;
      case 3: GemmKNColumnsF32<3>(xr, mr, k_dim, wb, ldw, n, n0, orow); break;
      case 2: GemmKNColumnsF32<2>(xr, mr, k_dim, wb, ldw, n, n0, orow); break;
      default: GemmKNColumnsF32<1>(xr, mr, k_dim, wb, ldw, n, n0, orow); break;
    }
  });
#else
  if (blocked) return ffi::Error::InvalidArgument("blocked weights need the AVX-512 kernels");
  MatmulAvx2<float>(pool, x.typed_data(), m_dim, k_dim, w.typed_data(), n, transpose_w, op);
  ZeroPaddingRows(op, m_dim, rows, n, 0, n);
#endif
  return ffi::Error::Success();
#else
  (void)pool; (void)x; (void)w; (void)live; (void)transpose_w; (void)out;
  return ffi::Error::InvalidArgument("this build has no float32 matmul (AVX-512F or AVX2)");
#endif
}

// ---- Several blocked matmuls of one x in one call: x [M, K] @ w_j -> out_j [M, N_j] f32 ----
// w_j: blocked [N_j / 64, K, 64] weights of x's dtype (bf16 or f32), e.g. a layer's q, k and v
// projections, or its gate and up projections. Why: every call's work is split over the
// threads on its own, so each ends with one thread waiting for the other's last block, and
// SmolLM2's k and v (3 blocks each) leave a thread idle for a third of their time. One call
// over all their blocks (15 for q, k and v, 48 for gate and up) splits them as one matmul
// would. SmolLM2's 30 layers' matmuls, separate against fused calls alternated in one process
// (/tmp script, 3 x 7 calls each): bf16 16 rows 13.2-14.8 -> 11.8-11.9 ms, 32 rows 22.2 ->
// 21.2, 64 rows 38.1 -> 36.8, 1 row 7.5-7.8 -> 7.5-7.6; float32 16 rows 22.7-23.3 -> 21.4-21.6,
// 64 rows 67.3-69.0 -> 66.2-66.6, 32 rows unchanged (38.5-40.4 both). Each
// output block is computed by the same tiles in the same order as the single matmul's:
// results are bitwise those of separate calls.
#if defined(__AVX512F__)
ffi::Error MatmulBlockedManyImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> live, ffi::RemainingArgs ws,
                                 ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (!bf16 && x.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("x must be bf16 or f32");
  }
#if !defined(__AVX512BF16__)
  if (bf16) return ffi::Error::InvalidArgument("this build has no bf16 blocked matmul");
#endif
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != outs.size() || ws.size() > 8) {
    return ffi::Error::InvalidArgument("want x [M, K] and 1-8 blocked weights, one out each");
  }
  const int64_t rows = xd[0], k_dim = xd[1];
  constexpr int64_t kMaxWeights = 8;
  const void* wps[kMaxWeights];
  float* ops[kMaxWeights];
  int64_t first_block[kMaxWeights + 1] = {0};  // weight j's blocks: [first[j], first[j + 1])
  const int64_t nw = static_cast<int64_t>(ws.size());
  bool paired = false;  // every w paired [N_j / 64, K / 2, 128] (bf16) instead of blocked
  for (int64_t j = 0; j < nw; ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto o = outs.get<ffi::AnyBuffer>(j);
    if (w.has_error()) return w.error();
    if (o.has_error()) return o.error();
    const auto wd = w->dimensions();
    if (j == 0) paired = bf16 && wd.size() == 3 && wd[2] == kPairedWidth;
    if (w->element_type() != x.element_type() || wd.size() != 3 ||
        wd[1] != (paired ? k_dim / 2 : k_dim) || k_dim % 2 != 0 ||
        wd[2] != (paired ? kPairedWidth : kBlockedColumns) ||
        (*o)->element_type() != ffi::DataType::F32 ||
        (*o)->dimensions().size() != 2 || (*o)->dimensions()[0] != rows ||
        (*o)->dimensions()[1] != wd[0] * kBlockedColumns) {
      return ffi::Error::InvalidArgument("each w must be blocked [N / 64, K, 64] (or all paired "
                                         "[N / 64, K / 2, 128], bf16) of x's dtype and its out "
                                         "[M, N] f32");
    }
    wps[j] = w->untyped_data();
    ops[j] = static_cast<float*>((*o)->untyped_data());
    first_block[j + 1] = first_block[j] + wd[0];
  }
  if (k_dim % (bf16 ? 32 : 16) != 0) return ffi::Error::InvalidArgument("K % 32 (16 f32)");
  if (rows == 0) return ffi::Error::Success();
  const int64_t m_dim = LiveRows(live, rows);
  const int64_t n_all = first_block[nw] * kBlockedColumns;  // the weights side by side
  const bool amx = bf16 && UseAmx();  // AMX: items are whole column blocks, every row
  const MatmulItems split = amx ? MatmulItems{first_block[nw], 1, m_dim}
                                : SplitMatmul(pool.num_threads(), m_dim, n_all, kBlockedColumns);
  const int64_t min_items = MatmulMinItems(split.chunk_rows, k_dim, kBlockedColumns);
  ParallelFor(pool, split.count(), min_items, [=](int64_t item) {
    int64_t n0, n1, r0, r1;
    split.Bounds(item, kBlockedColumns, n_all, m_dim, &n0, &n1, &r0, &r1);
    const int64_t block = n0 / kBlockedColumns;
    int64_t j = 0;
    while (block >= first_block[j + 1]) ++j;
    const int64_t n = (first_block[j + 1] - first_block[j]) * kBlockedColumns;
    const int64_t ln0 = (block - first_block[j]) * kBlockedColumns;  // within weight j
    float* op = ops[j];
    if (r0 == 0) ZeroPaddingRows(op, m_dim, rows, n, ln0, ln0 + kBlockedColumns);
    if (r1 <= r0) return;
    int64_t ldw;
    if (bf16) {
#if defined(__AVX512BF16__)
      const uint16_t* xr = static_cast<const uint16_t*>(x.untyped_data()) + r0 * k_dim;
      if (paired) {  // block (block - first_block[j]) of weight j: K / 2 rows of 128
        const uint16_t* wpb = static_cast<const uint16_t*>(wps[j]) + ln0 * k_dim;
#if defined(LLMSERVE_AMX)
        if (amx) {
          AmxKNPaired(xr, r1 - r0, k_dim, wpb, n, ln0, op + r0 * n);
          _tile_release();
          return;
        }
#endif
        GemmKNColumnsPaired(xr, r1 - r0, k_dim, wpb, n, ln0, op + r0 * n);
        return;
      }
      const uint16_t* wb = KNBlock(static_cast<const uint16_t*>(wps[j]), true, k_dim, n, ln0,
                                   &ldw);
#if defined(LLMSERVE_AMX)
      if (amx) {
        AmxKNColumns(xr, r1 - r0, k_dim, wb, ldw, n, ln0, kBlockedColumns, op + r0 * n);
        _tile_release();
        return;
      }
#endif
      GemmKNColumns<2>(xr, r1 - r0, k_dim, wb, ldw, n, ln0, op + r0 * n);
#endif
    } else {
      const float* xr = static_cast<const float*>(x.untyped_data()) + r0 * k_dim;
      const float* wb = KNBlock(static_cast<const float*>(wps[j]), true, k_dim, n, ln0, &ldw);
      GemmKNColumnsF32<4>(xr, r1 - r0, k_dim, wb, ldw, n, ln0, op + r0 * n);
    }
  });
  return ffi::Error::Success();
}
#else
ffi::Error MatmulBlockedManyImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> live, ffi::RemainingArgs ws,
                                 ffi::RemainingRets outs) {
  (void)pool; (void)x; (void)live; (void)ws; (void)outs;
  return ffi::Error::InvalidArgument("blocked weights need the AVX-512 kernels");
}
#endif

// Row log-sum-exp. XLA:CPU compiles exp and the sum over the vocabulary differently in different
// fusions (vectorized or not, depending on the surrounding program's shapes), so the same logits
// row gets log-sum-exps one ulp apart in a decode step and in a verify step. Here every row is
// reduced by the same code in the same order, whatever the batch or the thread: two passes (the
// maximum, then exp(x - max) summed in float64 lanes), rows spread over the thread pool. It is
// also the fast path for every emitted token's logprob: 256 rows of 49,152 logits (a 256-row
// decode step) 4.0 ms against XLA:CPU's fusion's 38.6, 32 rows 0.44 against 1.03.
#if defined(__AVX512F__)
// Adds 16 floats to two float64 accumulators (lanes 0-7 to lo, 8-15 to hi).
inline void AddF64(__m512 v, __m512d& lo, __m512d& hi) {
  lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                             _mm512_castps_pd(v), 1))));
}

// Logits row[i .. i + 16), lanes past the row's end v filled with fill.
inline __m512 LoadLogits16(const float* row, int64_t i, int64_t v, __m512 fill) {
  const int64_t n = std::min<int64_t>(16, v - i);
  const __mmask16 live = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1u);
  return _mm512_mask_loadu_ps(fill, live, row + i);
}
#endif

float RowLse(const float* row, int64_t v) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __m512 neg_inf = _mm512_set1_ps(-kInf);
  __m512 mx = neg_inf;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __m512 x = LoadLogits16(row, i, v, neg_inf);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, x);
  }
  const float top = _mm512_reduce_max_ps(mx);
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  if (!std::isfinite(top)) return top;  // all -inf: log(0); a +inf entry: +inf
  const __m512 t = _mm512_set1_ps(top);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < v; i += 16) {
    AddF64(ExpNonPositive16(_mm512_sub_ps(LoadLogits16(row, i, v, neg_inf), t)), s0, s1);
  }
  const double sum = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
  return top + static_cast<float>(std::log(sum));
#else
  float top = -kInf;
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(row[i])) return std::numeric_limits<float>::quiet_NaN();
    top = std::max(top, row[i]);
  }
  if (!std::isfinite(top)) return top;
  double sum = 0.0;  // float64: a float32 running sum over ~50k terms drifts by ~1e-5
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < v; ++i) sum += static_cast<double>(ExpNonPositive(row[i] - top));
  return top + static_cast<float>(std::log(sum));
#endif
}

ffi::Error RowLogsumexpImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("want logits [B, V]");
  const int64_t rows = dims[0], v = dims[1];
  if (v == 0) return ffi::Error::InvalidArgument("log-sum-exp over an empty row");
  const float* data = x.typed_data();
  float* res = out->typed_data();
  // A helper thread pays for waking it from about 0.5 MB of logits (~3 rows of 49,152).
  const int64_t min_rows = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, v));
  ParallelFor(pool, rows, min_rows, [=](int64_t b) { res[b] = RowLse(data + b * v, v); });
  return ffi::Error::Success();
}

// Row argmax, jnp.argmax's result: the first index of the row maximum, or of the first NaN
// when the row has one. Why: XLA:CPU runs the greedy argmax over the vocabulary as two
// reductions (the maximum, then the first index equal to it), 0.19 ms for a verify step's 10
// rows of 49,152 logits jitted alone; here each row is one pass (0.04 ms). Each lane keeps
// its first strict maximum and its index; the lanes then give the maximum and, among the lanes
// holding it, the smallest index. Rows are spread over the thread pool.
int32_t FirstNan(const float* row, int64_t v) {
  for (int64_t i = 0; i < v; ++i)
    if (std::isnan(row[i])) return static_cast<int32_t>(i);
  return -1;
}

int32_t RowArgmax(const float* row, int64_t v) {
#if defined(__AVX512F__)
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  __m512i best_idx = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __m512 x = LoadLogits16(row, i, v, neg_inf);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);  // strict: first one stays
    best = _mm512_mask_blend_ps(gt, best, x);
    best_idx = _mm512_mask_blend_epi32(gt, best_idx, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) return FirstNan(row, v);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // An all -inf row: no lane ever took a value (index 0, like jnp.argmax).
  const __m512i cand = _mm512_mask_blend_epi32(at_top, _mm512_set1_epi32(INT32_MAX), best_idx);
  return _mm512_reduce_min_epi32(cand);
#else
  float top = -std::numeric_limits<float>::infinity();
  int32_t arg = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(row[i])) return static_cast<int32_t>(i);
    if (row[i] > top) {
      top = row[i];
      arg = static_cast<int32_t>(i);
    }
  }
  return arg;
#endif
}

ffi::Error RowArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("want logits [B, V]");
  const int64_t rows = dims[0], v = dims[1];
  const float* data = x.typed_data();
  int32_t* res = out->typed_data();
  if (v == 0) return ffi::Error::InvalidArgument("argmax over an empty row");
  // A helper thread pays for waking it from about 1 MB of logits (~5 rows of 49,152).
  const int64_t min_rows = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, v));
  ParallelFor(pool, rows, min_rows, [=](int64_t b) { res[b] = RowArgmax(data + b * v, v); });
  return ffi::Error::Success();
}

// Sampling filters and the draw (llmserve/sampling.py's semantics, vLLM's order). Why: the
// JAX path finds top-k / top-p thresholds by bisection, up to 32 passes over [B, V] per
// threshold (XLA:CPU sorts are slower still): 229 ms for top-k 50 and 281 ms for top-p 0.9 on a
// 256-row step of 49,152 logits, against ~309 ms for the whole decode step. Here each row is a
// few passes: scale by 1/temperature and take the maximum; exp(x - max); a radix selection (three
// histograms over the order-preserving integer keys of the values, the later two over the few
// candidates left; first over the tokens near the maximum, see kTopWindow) for each threshold;
// one masked pass for the two-level inverse-CDF draw. sampling.sample at 256 rows: top-k 14 ms,
// top-p 15 ms (python -m experiments.sampler).
//
// Per row (temperature <= 0: a greedy row, left alone: threshold -inf, token 0):
//   x = logits / temperature, m = max x, e = exp(x - m);
//   top-k (0 < k < V): t_k = the k-th largest x (ties at t_k kept);
//   top-p (p < 1): t_p = the largest value t of the survivors with mass(x >= t) >= target,
//     target = max(p * mass(x >= t_k), 0.5) (the mass of the maximum alone is 1);
//   min-p (> 0): x >= m + log(min_p);
//   t = the largest of those that apply; token: the inverse CDF of e over x >= t at
//   uniform * mass, in blocks of 256 tokens (a rounding overshoot clamps to the last kept
//   token). Masses are summed in float64. Each row's arithmetic depends on that row alone.
// The threshold returned is in raw logits, the smallest kept one: x >= t <=> logits >= it.
// (XLA:CPU divides by the temperature with a refined reciprocal, not IEEE division, so the
// caller's own x may differ from ours by an ulp; a raw-logit threshold means the same set.)
inline uint32_t OrderKey(float f) {  // x < y  <=>  key(x) < key(y), for non-NaN x, y
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

inline float KeyValue(uint32_t k) {  // OrderKey's inverse
  const uint32_t u = (k >> 31) ? (k & 0x7fffffffu) : ~k;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct SampleScratch {
  std::vector<float> x, e;
  std::vector<int32_t> cand, a, b;
  std::vector<double> block;
};

#if defined(__AVX512F__)
inline __mmask16 TailMask(int64_t left) {  // the first min(left, 16) lanes
  return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1u);
}

inline __m512i OrderKey16(__m512 f) {  // OrderKey, 16 lanes: u ^ (sign ? ~0 : 0x80000000)
  const __m512i u = _mm512_castps_si512(f);
  return _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31),
                                             _mm512_set1_epi32(INT32_MIN)));
}
#endif

// The indices i in [0, v) with lo <= OrderKey(x[i]) <= hi, in order, into out.
void GatherKeyRange(const float* x, int64_t v, uint32_t lo, uint32_t hi,
                    std::vector<int32_t>& out) {
  out.resize(v + 16);  // room for a whole vector store past the last index
  int32_t* o = out.data();
  int64_t n = 0;
#if defined(__AVX512F__)
  const __m512i vlo = _mm512_set1_epi32(static_cast<int32_t>(lo));
  const __m512i vhi = _mm512_set1_epi32(static_cast<int32_t>(hi));
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 live = TailMask(v - i);
    const __m512i key = OrderKey16(_mm512_maskz_loadu_ps(live, x + i));
    const __mmask16 in = live & _mm512_cmp_epu32_mask(key, vlo, _MM_CMPINT_NLT) &
                         _mm512_cmp_epu32_mask(key, vhi, _MM_CMPINT_LE);
    // Compress in a register, then a plain store (a compressing store to memory is
    // microcoded on AMD Zen 4, ~10x slower).
    _mm512_storeu_si512(o + n, _mm512_maskz_compress_epi32(in, idx));
    n += __builtin_popcount(in);
    idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
  }
#else
  for (int64_t i = 0; i < v; ++i) {
    const uint32_t key = OrderKey(x[i]);
    if (key >= lo && key <= hi) o[n++] = static_cast<int32_t>(i);
  }
#endif
  out.resize(n);
}

// The largest key t with weight(candidates with key >= t) >= target, where the candidates are
// cand[0 .. n) (every index 0 .. n - 1 when cand is null) and the weight of index i is
// weight(i) >= 0 (a count or a mass). The caller guarantees the candidates' total reaches
// target. Three radix levels (11, 11 and 10 bits of the key): each level histograms the
// weights of the candidates still sharing the chosen prefix, walks the bins from the top, and
// keeps the bin where the running weight reaches target. Level 0 over a whole row keeps two
// interleaved histograms (neighbouring logits often share a bin: one histogram would wait on
// its own last store) and gathers the chosen bin's indices with vector compress stores.
template <typename Weight>
uint32_t SelectKey(const float* x, const int32_t* cand, int64_t n, double target, Weight weight,
                   SampleScratch& s) {
  constexpr int kShift[3] = {21, 10, 0};
  constexpr int kBins[3] = {2048, 2048, 1024};
  double hist[2][2048];
  double above = 0.0;  // weight of the candidates above the chosen prefix
  uint32_t prefix = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level];
    const uint32_t mask = static_cast<uint32_t>(kBins[level] - 1);
    std::fill(hist[0], hist[0] + kBins[level], 0.0);
    std::fill(hist[1], hist[1] + kBins[level], 0.0);
    if (cand) {
      for (int64_t j = 0; j < n; ++j)
        hist[j & 1][(OrderKey(x[cand[j]]) >> shift) & mask] += weight(cand[j]);
    } else {
#if defined(__AVX512F__)
      alignas(64) uint32_t digit[16];
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = TailMask(n - i);
        _mm512_store_si512(digit, _mm512_srli_epi32(
            OrderKey16(_mm512_maskz_loadu_ps(live, x + i)), shift));
        const int64_t m = std::min<int64_t>(16, n - i);
        for (int64_t l = 0; l < m; ++l) hist[l & 1][digit[l]] += weight(i + l);
      }
#else
      for (int64_t i = 0; i < n; ++i) hist[i & 1][OrderKey(x[i]) >> shift] += weight(i);
#endif
    }
    uint32_t bin = static_cast<uint32_t>(kBins[level] - 1);
    for (; bin > 0; --bin) {
      const double w = hist[0][bin] + hist[1][bin];
      if (above + w >= target) break;
      above += w;
    }
    prefix |= bin << shift;
    if (level == 2) break;
    std::vector<int32_t>& out = level == 0 ? s.a : s.b;
    if (!cand) {
      GatherKeyRange(x, n, prefix, prefix | ((1u << shift) - 1u), out);
    } else {
      out.clear();
      for (int64_t j = 0; j < n; ++j)
        if (((OrderKey(x[cand[j]]) >> shift) & mask) == bin) out.push_back(cand[j]);
    }
    cand = out.data();
    n = static_cast<int64_t>(out.size());
  }
  return prefix;
}

// x = logits / temperature (IEEE division) into x, -0 as +0 (so that OrderKey orders x exactly
// as float comparisons do); returns max x.
float ScaleRow(const float* logits, int64_t v, float temperature, float* x) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(temperature);
  __m512 mx = _mm512_set1_ps(-kInf);
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 live = TailMask(v - i);
    const __m512 xi = _mm512_add_ps(_mm512_div_ps(_mm512_mask_loadu_ps(
        _mm512_set1_ps(-kInf), live, logits + i), t), _mm512_setzero_ps());
    _mm512_mask_storeu_ps(x + i, live, xi);
    mx = _mm512_max_ps(mx, xi);
  }
  return _mm512_reduce_max_ps(mx);
#else
  float m = -kInf;
  for (int64_t i = 0; i < v; ++i) {
    x[i] = logits[i] / temperature + 0.0f;
    m = std::max(m, x[i]);
  }
  return m;
#endif
}

// e = exp(x - m) into e; returns its sum (float64).
double ExpRow(const float* x, int64_t v, float m, float* e) {
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(m);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 live = TailMask(v - i);
    const __m512 xi = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                           live, x + i);
    const __m512 ei = ExpNonPositive16(_mm512_sub_ps(xi, top));
    _mm512_mask_storeu_ps(e + i, live, ei);
    AddF64(ei, s0, s1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
#else
  double sum = 0.0;
  for (int64_t i = 0; i < v; ++i) sum += (e[i] = ExpNonPositive(x[i] - m));
  return sum;
#endif
}

// e[i] = exp(x[i] - m) for i in idx[0 .. n); returns their sum (float64). The same exp as
// ExpRow's (the vector polynomial and the scalar one differ in the last bit).
double ExpAt(const float* x, const int32_t* idx, int64_t n, float m, float* e) {
  double sum = 0.0;
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(m);
  alignas(64) float buf[16];
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = TailMask(n - j);
    const __m512i ij = _mm512_maskz_loadu_epi32(live, idx + j);
    const __m512 xj = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, ij, x, 4);
    _mm512_store_ps(buf, ExpNonPositive16(_mm512_sub_ps(xj, top)));
    const int64_t left = std::min<int64_t>(16, n - j);
    for (int64_t l = 0; l < left; ++l) sum += (e[idx[j + l]] = buf[l]);
  }
#else
  for (int64_t j = 0; j < n; ++j) sum += (e[idx[j]] = ExpNonPositive(x[idx[j]] - m));
#endif
  return sum;
}

#if defined(__AVX512F__)
// x[0 .. 16) (live lanes) >= t ? exp(x - top) : 0, the terms of KeptMass and KeptMasses.
inline __m512 KeptExp16(const float* x, __mmask16 live, __m512 top, __m512 t) {
  const __m512 xi = _mm512_maskz_loadu_ps(live, x);
  const __mmask16 keep = live & _mm512_cmp_ps_mask(xi, t, _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, ExpNonPositive16(_mm512_sub_ps(xi, top)));
}
#endif

// w[i] = x[i] >= t ? exp(x[i] - m) : 0 for i in [0, n): KeptMass's terms, one by one.
void KeptMasses(const float* x, int64_t n, float m, float t, float* w) {
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(m), tv = _mm512_set1_ps(t);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = TailMask(n - i);
    _mm512_mask_storeu_ps(w + i, live, KeptExp16(x + i, live, top, tv));
  }
#else
  for (int64_t i = 0; i < n; ++i) w[i] = x[i] >= t ? ExpNonPositive(x[i] - m) : 0.0f;
#endif
}

// sum of exp(x[i] - m) over i in [lo, hi) with x[i] >= t (float64).
double KeptMass(const float* x, int64_t lo, int64_t hi, float m, float t) {
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(m), tv = _mm512_set1_ps(t);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int64_t i = lo; i < hi; i += 16) AddF64(KeptExp16(x + i, TailMask(hi - i), top, tv), s0, s1);
  return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
#else
  double sum = 0.0;
  for (int64_t i = lo; i < hi; ++i) sum += x[i] >= t ? ExpNonPositive(x[i] - m) : 0.0f;
  return sum;
#endif
}

// The smallest logits[i] with x[i] >= t (+inf when none).
float SmallestKept(const float* logits, const float* x, int64_t v, float t) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(t);
  __m512 mn = _mm512_set1_ps(kInf);
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 live = TailMask(v - i);
    const __mmask16 keep =
        live & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(live, x + i), tv, _CMP_GE_OQ);
    mn = _mm512_mask_min_ps(mn, keep, mn, _mm512_maskz_loadu_ps(live, logits + i));
  }
  return _mm512_reduce_min_ps(mn);
#else
  float lo = kInf;
  for (int64_t i = 0; i < v; ++i)
    if (x[i] >= t) lo = std::min(lo, logits[i]);
  return lo;
#endif
}

// Top-k and top-p first look at the tokens with x >= max - kTopWindow (probability >= e^-9 ~
// 1.2e-4 of the top token's): a few hundred of SmolLM2's 49,152 on real logits, ~3% on N(0, 3)
// noise at temperature 0.7. When fewer than k tokens, or less than the target mass, lie there,
// the selection runs over the whole row instead.
constexpr float kTopWindow = 9.0f;

void SampleRow(const float* logits, int64_t v, float temperature, int32_t top_k, float top_p,
               float min_p, float uniform, bool draw, int32_t* token, float* threshold,
               SampleScratch& s) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  *token = 0;
  *threshold = -kInf;
  if (!(temperature > 0.0f)) return;  // greedy
  const int64_t k = (top_k > 0 && top_k < v) ? top_k : v;
  const bool filters = k < v || top_p < 1.0f;
  if (!filters && !(min_p > 0.0f) && !draw) return;  // nothing to find
  s.x.resize(v);
  float* x = s.x.data();
  const float m = ScaleRow(logits, v, temperature, x);
  if (!std::isfinite(m)) return;  // all -inf (or +inf / NaN): nothing sensible to draw
  float t = -kInf;
  if (filters) {
    const int32_t* cand = nullptr;  // the top-k survivors (null: the whole row)
    int64_t n = v;
    if (k < v) {
      // As for top-p: when k tokens lie within the window of the maximum, the k-th largest is
      // one of them, and its survivors are too.
      GatherKeyRange(x, v, OrderKey(m - kTopWindow), 0xFFFFFFFFu, s.cand);
      const auto one = [](int64_t) { return 1.0; };
      const int64_t near = static_cast<int64_t>(s.cand.size());
      if (near >= k) {
        t = KeyValue(SelectKey(x, s.cand.data(), near, static_cast<double>(k), one, s));
        s.cand.erase(std::remove_if(s.cand.begin(), s.cand.end(),
                                    [x, t](int32_t i) { return !(x[i] >= t); }),
                     s.cand.end());
      } else {
        t = KeyValue(SelectKey(x, nullptr, v, static_cast<double>(k), one, s));
        GatherKeyRange(x, v, OrderKey(t), 0xFFFFFFFFu, s.cand);
      }
      cand = s.cand.data();
      n = static_cast<int64_t>(s.cand.size());
    }
    if (top_p < 1.0f) {
      s.e.resize(v);
      float* e = s.e.data();
      double mass = 0.0;
      if (cand) {
        mass = ExpAt(x, cand, n, m, e);
      } else {
        mass = ExpRow(x, v, m, e);
      }
      const double target = std::max(static_cast<double>(top_p) * mass, 0.5);
      if (!cand) {
        // Usually the tokens within kTopWindow of the maximum already hold the target mass;
        // then the threshold is one of theirs (every token at or above any of their values is
        // among them), and the selection runs over them alone instead of the whole row.
        GatherKeyRange(x, v, OrderKey(m - kTopWindow), 0xFFFFFFFFu, s.cand);
        double near = 0.0;
        for (const int32_t i : s.cand) near += e[i];
        if (near >= target) {
          cand = s.cand.data();
          n = static_cast<int64_t>(s.cand.size());
        }
      }
      t = KeyValue(SelectKey(x, cand, n, target, [e](int64_t i) { return double(e[i]); }, s));
    }
  }
  if (min_p > 0.0f) t = std::max(t, m + std::log(min_p));
  // As a raw logit: the smallest kept one (division is monotone: the same set).
  if (t > -kInf) *threshold = SmallestKept(logits, x, v, t);
  if (!draw) return;
  // Block masses of the kept tokens, then the block and the token at uniform * total.
  constexpr int64_t kBlock = 256;
  const int64_t nb = (v + kBlock - 1) / kBlock;
  s.block.resize(nb);
  double total = 0.0;
  int64_t last_block = 0;
  for (int64_t j = 0; j < nb; ++j) {
    const double bm = KeptMass(x, j * kBlock, std::min(v, (j + 1) * kBlock), m, t);
    s.block[j] = bm;
    total += bm;
    if (bm > 0.0) last_block = j;
  }
  const double target = static_cast<double>(uniform) * total;
  double before = 0.0;
  int64_t blk = last_block;
  for (int64_t j = 0; j < nb; ++j) {
    if (before + s.block[j] > target) {
      blk = j;
      break;
    }
    before += s.block[j];
  }
  if (blk == last_block) {  // the clamped block's "before": recompute it in the same order
    before = 0.0;
    for (int64_t j = 0; j < blk; ++j) before += s.block[j];
  }
  const int64_t lo = blk * kBlock, hi = std::min(v, lo + kBlock);
  alignas(64) float w_block[kBlock];  // the block's kept masses, as KeptMass computed them
  KeptMasses(x + lo, hi - lo, m, t, w_block);
  double run = before;
  int64_t pick = -1, last = lo;
  for (int64_t i = lo; i < hi; ++i) {
    const double w = w_block[i - lo];
    if (w > 0.0) last = i;
    run += w;
    if (pick < 0 && run > target) pick = i;
  }
  *token = static_cast<int32_t>(pick < 0 ? last : std::min(pick, last));
}

ffi::Error SampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::S32> top_k,
                      ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                      ffi::Buffer<ffi::F32> uniform, bool draw,
                      ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                      ffi::Result<ffi::Buffer<ffi::F32>> thresholds) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("want logits [B, V]");
  const int64_t rows = dims[0], v = dims[1];
  if (v == 0) return ffi::Error::InvalidArgument("sampling from an empty vocabulary");
  for (const int64_t n : {temperature.element_count(), top_k.element_count(),
                          top_p.element_count(), min_p.element_count(),
                          uniform.element_count()})
    if (n != rows) return ffi::Error::InvalidArgument("want one parameter per row ([B])");
  const float* data = logits.typed_data();
  const float* temp = temperature.typed_data();
  const int32_t* kk = top_k.typed_data();
  const float* pp = top_p.typed_data();
  const float* mp = min_p.typed_data();
  const float* uu = uniform.typed_data();
  int32_t* tok = tokens->typed_data();
  float* thr = thresholds->typed_data();
  // A row is a few passes over its logits: a helper thread pays for itself from ~2 rows.
  const int64_t min_rows = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, v));
  ParallelFor(pool, rows, min_rows, [=](int64_t b) {
    thread_local SampleScratch scratch;
    SampleRow(data + b * v, v, temp[b], kk[b], pp[b], mp[b], uu[b], draw, tok + b, thr + b,
              scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmserveRowLogsumexp, RowLogsumexpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [B, V]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmserveRowArgmax, RowArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [B, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmserveSample, SampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [B] (<= 0: greedy)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // uniform [B]
                                  .Attr<bool>("draw")
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tokens [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // thresholds [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::AnyBuffer>()       // k_pages
                                  .Arg<ffi::AnyBuffer>()       // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmserveMatmulBf16, MatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // w [K, N] or [N, K] bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows []
                                  .Attr<bool>("transpose_w")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmserveMatmulF32, MatmulF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N] or [N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows []
                                  .Attr<bool>("transpose_w")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmserveMatmulBlockedMany, MatmulBlockedManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16 or f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows []
                                  .RemainingArgs()  // blocked w_j [N_j / 64, K, 64]
                                  .RemainingRets());  // out_j [M, N_j] f32

// 1 when this build has the float32 matmul (the CPU it was built for has AVX-512F or AVX2 + FMA).
extern "C" int LlmserveHasF32Matmul() {
#if defined(__AVX512F__) || defined(LLMSERVE_AVX2_MATMUL)
  return 1;
#else
  return 0;
#endif
}

// Whether the bf16 matmuls use AMX tiles: mode 0 or 1 sets it (1: where this build and the CPU
// have them), -1 only asks. Returns 1 when they do from now on.
extern "C" int LlmserveAmxMatmul(int mode) {
  if (mode >= 0) g_amx_matmul.store(mode != 0 ? 1 : 0);
  return UseAmx() ? 1 : 0;
}

// 1 when this build has the bf16 matmul (AVX512_BF16, or AVX2 + FMA widening bf16 to float32).
extern "C" int LlmserveHasBf16Matmul() {
#if defined(__AVX512BF16__) || defined(LLMSERVE_AVX2_MATMUL)
  return 1;
#else
  return 0;
#endif
}
