// Weight-only int8 linear layer for a few rows of fp32 activations, on AVX2 + FMA.
//
//     y[m, n] = scales[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
//
// Decoding reads every weight once per forward, so with few rows (one token, or the K + 1 tokens
// of a speculative verification) the cost is the bytes of `w`: int8 reads a quarter of fp32's.
// The kernel converts each block of 8 int8 weights to fp32 once and uses it for every row of x in
// the call, so the compute per weight grows with the rows while the bytes stay fixed.
//
// Exactness across row counts: every output element is the same sequence of operations whatever
// the number of rows M in the call -- lane j of one 8-wide accumulator sums x[m, k] * w[n, k] over
// k = j, j + 8, ... in increasing k with fused multiply-adds, then the 8 lanes are summed in a
// fixed order and scaled. The row count only changes which (m, n) pairs share a loop (instruction
// level parallelism comes from several weight rows n for few x rows, from several x rows
// otherwise), never the arithmetic of one pair. So a speculative verification over K + 1 tokens
// gives bit-for-bit the logits that K + 1 one-token forwards would.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);                      // lanes (0+4, 1+5, 2+6, 3+7)
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));   // (0+4+2+6, 1+5+3+7, ...)
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

inline __m256 load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// MB rows of x times NB consecutive weight rows starting at n.
template <int MB, int NB>
inline void block(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scales,
                  const float* bias, float* y, int64_t ldy, int64_t n) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps();
  const int8_t* wr = w + n * K;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int b = 0; b < NB; ++b) {
      const __m256 wv = load_w8(wr + b * K + k);
      for (int m = 0; m < MB; ++m) acc[m][b] = _mm256_fmadd_ps(xv[m], wv, acc[m][b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const float s = scales[n + b];
    const float c = bias ? bias[n + b] : 0.0f;
    for (int m = 0; m < MB; ++m) y[m * ldy + n + b] = hsum8(acc[m][b]) * s + c;
  }
}

// Weight rows chosen so that MB * NB accumulators, MB x vectors and one weight vector fit in the
// 16 ymm registers, with at least ~6 independent FMA chains.
template <int MB>
constexpr int rows_of_w() {
  return MB == 1 ? 8 : MB == 2 ? 4 : MB == 3 ? 3 : MB <= 5 ? 2 : 1;
}

template <int MB>
void rows(const float* x, int64_t ldx, const int8_t* w, int64_t N, int64_t K, const float* scales,
          const float* bias, float* y, int64_t ldy) {
  constexpr int NB = rows_of_w<MB>();
  const int64_t blocks = N / NB;
  // ~64 KB of weights per task keeps the two threads' shares even without tiny tasks.
  const int64_t grain = std::max<int64_t>(1, (65536 / std::max<int64_t>(K, 1)) / NB);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<MB, NB>(x, ldx, w, K, scales, bias, y, ldy, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<MB, 1>(x, ldx, w, K, scales, bias, y, ldy, n);
}

using RowsFn = void (*)(const float*, int64_t, const int8_t*, int64_t, int64_t, const float*,
                        const float*, float*, int64_t);

constexpr int kMaxRows = 12;
constexpr RowsFn kRows[kMaxRows + 1] = {nullptr,   rows<1>,  rows<2>, rows<3>, rows<4>,
                                       rows<5>,   rows<6>,  rows<7>, rows<8>, rows<9>,
                                       rows<10>,  rows<11>, rows<12>};

}  // namespace

bool supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

int64_t max_rows_per_pass() { return kMaxRows; }

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(supported(), "int8_linear needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "int8_linear runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "int8_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "int8_linear: x must be float32");
  TORCH_CHECK(w.scalar_type() == torch::kInt8, "int8_linear: w must be int8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == w.size(0),
              "int8_linear: scales must be float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "int8_linear: x has ", K, " columns, w has ", w.size(1));
  TORCH_CHECK(K % 8 == 0, "int8_linear: in_features must be a multiple of 8, got ", K);
  const float* bptr = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "int8_linear: bias must be float32 [N]");
    bptr = b.data_ptr<float>();
  }
  const torch::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scales.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  // Rows in passes of at most kMaxRows, as even as possible (13 rows: 7 + 6, not 12 + 1).
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  int64_t m0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t mb = (M - m0 + (passes - p) - 1) / (passes - p);
    kRows[mb](xp + m0 * K, K, wp, N, K, sc.data_ptr<float>(), bptr, yp + m0 * N, N);
    m0 += mb;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = (x w^T) * scales + bias for int8 w, fp32 x (AVX2)");
  m.def("supported", &supported, "whether this CPU has AVX2 and FMA");
  m.def("max_rows_per_pass", &max_rows_per_pass, "rows of x one pass over the weights serves");
}
