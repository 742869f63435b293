// The compiled decoding step's attention on a CPU (and the compiled encoder's): a few queries per row over a
// cache of keys and values (every position's, in the encoder), each row over its own first `lengths[b]`
// positions (model/kernels.py builds it and says why it exists).
//
//   queries (B, Q, H * D), keys (B, H, S, D), values (B, H, S, D), lengths (B,) int64
//   -> out (B, Q, H * D): head h's D columns of out[b, j] = softmax(queries[b, j, head h] keys[b, h, :L]^T / sqrt(D))
//   values[b, h, :L], L = lengths[b]
//
// Queries and out as the projections make and take them, the heads side by side in a row: no copies around it
// (a view into heads ahead of it made inductor write the query projection's epilogue as a scalar loop).
//
// The written-out attention (compiled.attend, inductor's code) summed each position's products across a vector's
// lanes on its own, a chain of shuffles per position; here W positions' sums are made at once (lane_sums). A
// row reads its first L positions only, so the padding of a batch's shorter sources and the cache's unwritten
// positions are never read. Arithmetic in float32 whatever the inputs' dtype (float32 or bfloat16), as the
// written-out attention's.
//
// SEQ2SEQ_OPS names the operator library (seq2seq_avx512, seq2seq_avx2, seq2seq_default: one build per
// instruction set, CPU_CAPABILITY_* selecting ATen's vector types, so that a test can run a set the machine
// does not take).

// The tensor's methods and the one operator it calls, not <ATen/ATen.h>: every operator's declaration, parsed by
// each build, and a build is made on a machine's first use.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// The first n (at most W) values at p as float32; a full vector when n >= W.
inline Vec load_float(const float* p, int64_t n) { return n >= W ? Vec::loadu(p) : Vec::loadu(p, n); }
inline Vec load_float(const at::BFloat16* p, int64_t n) {
  if (n >= W) {
    Vec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
  }
  return std::get<0>(at::vec::convert_bfloat16_float(at::vec::Vectorized<at::BFloat16>::loadu(p, n)));
}

// The sums of each of W vectors' lanes, as one vector: sums[j] = sum of acc[j]'s lanes. A tree of
// deinterleaves: deinterleave2(a, b)'s halves added are a's pairwise sums then b's, so log2(W) levels leave
// one lane per vector, in order (~3 operations a vector, where summing each across its lanes takes ~10).
inline Vec lane_sums(Vec* acc) {
#pragma GCC unroll 8
  for (int64_t width = W; width > 1; width /= 2) {
#pragma GCC unroll 16
    for (int64_t j = 0; j < width / 2; ++j) {
      const auto halves = at::vec::deinterleave2(acc[2 * j], acc[2 * j + 1]);
      acc[j] = halves.first + halves.second;
    }
  }
  return acc[0];
}

// scores[0, L) = q . keys[s] for s < L (q zero-padded to a whole number of vectors): W positions at a time, each
// position's products summed in a vector of its own (the positions' sums independent, for the FMA units to
// overlap), then those vectors' lanes summed at once (lane_sums).
template <typename T>
void scores_of(const float* q, const T* keys, int64_t row_stride, int64_t D, int64_t L, float* scores) {
  for (int64_t s0 = 0; s0 < L; s0 += W) {
    const int64_t n = std::min<int64_t>(W, L - s0);
    const T* rows = keys + s0 * row_stride;
    const T* row[W];  // (a last block's rows past L read row n - 1 again, their sums unused: no test in the loops,
    // which would keep acc in memory, not in registers)
#pragma GCC unroll 16
    for (int64_t j = 0; j < W; ++j) row[j] = rows + std::min<int64_t>(j, n - 1) * row_stride;
    Vec acc[W];
#pragma GCC unroll 16
    for (int64_t j = 0; j < W; ++j) acc[j] = Vec(0.f);
    if (D % W == 0) {
      for (int64_t d = 0; d < D; d += W) {
        const Vec qd = Vec::loadu(q + d);
#pragma GCC unroll 16
        for (int64_t j = 0; j < W; ++j) acc[j] = at::vec::fmadd(qd, load_float(row[j] + d, W), acc[j]);
      }
    } else {
      for (int64_t d = 0; d < D; d += W) {
        const Vec qd = Vec::loadu(q + d);
#pragma GCC unroll 16
        for (int64_t j = 0; j < W; ++j) acc[j] = at::vec::fmadd(qd, load_float(row[j] + d, D - d), acc[j]);
      }
    }
    lane_sums(acc).store(scores + s0);  // (the buffer has W floats of room past S)
  }
}

// scores[0, L) -> exp(scale * scores - max), in place; returns 1 / their sum.
inline float softmax_numerators(float* scores, int64_t L, float scale) {
  const Vec vscale(scale);
  Vec peak(-std::numeric_limits<float>::infinity());
  int64_t s = 0;
  for (; s + W <= L; s += W) {
    const Vec x = Vec::loadu(scores + s) * vscale;
    x.store(scores + s);
    peak = at::vec::maximum(peak, x);
  }
  if (s < L) {
    const Vec x = Vec::loadu(scores + s, L - s) * vscale;
    x.store(scores + s, L - s);
    peak = at::vec::maximum(peak, Vec::set(Vec(-std::numeric_limits<float>::infinity()), x, L - s));
  }
  const Vec vpeak(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, peak));
  Vec total(0.f);
  for (s = 0; s + W <= L; s += W) {
    const Vec e = (Vec::loadu(scores + s) - vpeak).exp_u20();
    e.store(scores + s);
    total = total + e;
  }
  if (s < L) {
    const Vec e = (Vec::loadu(scores + s, L - s) - vpeak).exp_u20();
    e.store(scores + s, L - s);
    total = total + Vec::set(Vec(0.f), e, L - s);
  }
  return 1.f / at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
}

// out[0, D) = inv * sum over s < L of weights[s] * values[s, :], by blocks of 4W head dimensions.
template <typename T>
void weighted_sum(const float* weights, float inv, const T* values, int64_t row_stride, int64_t D, int64_t L,
                  float* out) {
  const Vec vinv(inv);
  for (int64_t d0 = 0; d0 < D; d0 += 4 * W) {
    const int64_t n = std::min<int64_t>(4 * W, D - d0);
    Vec c0(0.f), c1(0.f), c2(0.f), c3(0.f);
    if (n == 4 * W) {  // (no test inside the loop)
      for (int64_t s = 0; s < L; ++s) {
        const Vec w(weights[s]);
        const T* row = values + s * row_stride + d0;
        c0 = at::vec::fmadd(w, load_float(row, W), c0);
        c1 = at::vec::fmadd(w, load_float(row + W, W), c1);
        c2 = at::vec::fmadd(w, load_float(row + 2 * W, W), c2);
        c3 = at::vec::fmadd(w, load_float(row + 3 * W, W), c3);
      }
    } else {
      for (int64_t s = 0; s < L; ++s) {
        const Vec w(weights[s]);
        const T* row = values + s * row_stride + d0;
        c0 = at::vec::fmadd(w, load_float(row, n), c0);
        if (n > W) c1 = at::vec::fmadd(w, load_float(row + W, n - W), c1);
        if (n > 2 * W) c2 = at::vec::fmadd(w, load_float(row + 2 * W, n - 2 * W), c2);
        if (n > 3 * W) c3 = at::vec::fmadd(w, load_float(row + 3 * W, n - 3 * W), c3);
      }
    }
    (c0 * vinv).store(out + d0, std::min<int64_t>(n, W));
    if (n > W) (c1 * vinv).store(out + d0 + W, std::min<int64_t>(n - W, W));
    if (n > 2 * W) (c2 * vinv).store(out + d0 + 2 * W, std::min<int64_t>(n - 2 * W, W));
    if (n > 3 * W) (c3 * vinv).store(out + d0 + 3 * W, std::min<int64_t>(n - 3 * W, W));
  }
}

// Asks for rows [0, L) of D values each, `row_stride` apart, to be brought into the caches.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t row_stride, int64_t L, int64_t D) {
  constexpr int64_t line = 64 / sizeof(T);  // (values a cache line)
  for (int64_t s = 0; s < L; ++s) {
    for (int64_t d = 0; d < D; d += line) __builtin_prefetch(rows + s * row_stride + d);
  }
}

template <typename T>
void attend(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths,
            at::Tensor& out) {
  const int64_t B = queries.size(0), Q = queries.size(1), H = keys.size(1), D = keys.size(3);
  const int64_t S = keys.size(2);
  const T* q = queries.const_data_ptr<T>();
  const T* k = keys.const_data_ptr<T>();
  const T* v = values.const_data_ptr<T>();
  const int64_t* length = lengths.const_data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // (b, h) pairs shared among the intra-op threads: each reads its own keys and values
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (D + W - 1) / W * W;
    std::vector<float> scores(S + W), q_row(padded, 0.f), out_row(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      const int64_t L = std::clamp<int64_t>(length[b * lengths.stride(0)], 0, S);
      const T* row_keys = k + b * keys.stride(0) + h * keys.stride(1);
      const T* vals = v + b * values.stride(0) + h * values.stride(1);
      if (i + 1 < end) {  // the next pair's keys and values fetched while this one's are worked: a step's
        // keys and values come from memory, not the caches, and the pairs' short runs of rows leave the hardware
        // prefetchers little to go on
        const int64_t nb = (i + 1) / H, nh = (i + 1) % H;
        const int64_t next = std::clamp<int64_t>(length[nb * lengths.stride(0)], 0, S);
        prefetch_rows(k + nb * keys.stride(0) + nh * keys.stride(1), keys.stride(2), next, D);
        prefetch_rows(v + nb * values.stride(0) + nh * values.stride(1), values.stride(2), next, D);
      }
      for (int64_t j = 0; j < Q; ++j) {
        const T* query = q + b * queries.stride(0) + j * queries.stride(1) + h * D;
        T* dest = o + b * out.stride(0) + j * out.stride(1) + h * D;
        if (L == 0) {  // nothing to attend to: zeros (a row no search reads)
          std::fill(dest, dest + D, static_cast<T>(0.f));
          continue;
        }
        at::vec::convert(query, q_row.data(), D);
        scores_of(q_row.data(), row_keys, keys.stride(2), D, L, scores.data());
        const float inv = softmax_numerators(scores.data(), L, scale);
        weighted_sum(scores.data(), inv, vals, values.stride(2), D, L, out_row.data());
        at::vec::convert(out_row.data(), dest, D);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& lengths) {
  TORCH_CHECK(queries.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && lengths.dim() == 1,
              "decode_attention: queries (B, Q, H * D), keys and values (B, H, S, D), lengths (B,)");
  const int64_t B = queries.size(0), H = keys.size(1), D = keys.size(3), S = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && queries.size(2) == H * D, "decode_attention: keys ", keys.sizes(),
              " do not fit queries ", queries.sizes());
  TORCH_CHECK(values.sizes() == keys.sizes(), "decode_attention: values ", values.sizes(), " are not the keys' ",
              keys.sizes());
  TORCH_CHECK(lengths.size(0) == B && lengths.scalar_type() == at::kLong, "decode_attention: lengths (B,) int64");
  const auto dtype = queries.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && keys.scalar_type() == dtype &&
                  values.scalar_type() == dtype, "decode_attention: float32 or bfloat16 queries, keys and values");
  const auto q = queries.stride(2) == 1 ? queries : queries.contiguous();
  const auto k = keys.stride(3) == 1 ? keys : keys.contiguous();
  const auto v = values.stride(3) == 1 ? values : values.contiguous();
  auto out = at::empty(queries.sizes(), queries.options());
  if (dtype == at::kFloat) {
    attend<float>(q, k, v, lengths, out);
  } else {
    attend<at::BFloat16>(q, k, v, lengths, out);
  }
  return out;
}

}  // namespace

#define SEQ2SEQ_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)          // (expands SEQ2SEQ_OPS before TORCH_LIBRARY pastes it)
#define SEQ2SEQ_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

SEQ2SEQ_LIBRARY(SEQ2SEQ_OPS, m) {
  m.def("decode_attention(Tensor queries, Tensor keys, Tensor values, Tensor lengths) -> Tensor");
}

SEQ2SEQ_LIBRARY_IMPL(SEQ2SEQ_OPS, m) { m.impl("decode_attention", decode_attention); }
