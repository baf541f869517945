// The fp32 matmuls against their contract (kernels/gemm.h): every output element is the FMA
// chain over k in order, from +0 or from C. The reference below spells that chain out with
// std::fma, so every comparison is bitwise, on every SIMD target this CPU runs.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "core/simd.h"
#include "kernels/gemm.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;

namespace {

enum class Op { NT, NN, TN };
const char* op_name(Op op) { return op == Op::NT ? "nt" : op == Op::NN ? "nn" : "tn"; }

// Operands of one product C[M,N] (+)= op(A)·op(B) with padded leading dimensions.
struct Case {
  Op op;
  int64_t M, N, K;
  int64_t lda, ldb, ldc;
  std::vector<float> A, B, C0;

  float a(int64_t i, int64_t k) const { return op == Op::TN ? A[k * lda + i] : A[i * lda + k]; }
  float b(int64_t k, int64_t j) const { return op == Op::NT ? B[j * ldb + k] : B[k * ldb + j]; }
};

Case make_case(Op op, int64_t M, int64_t N, int64_t K, uint64_t seed, int64_t pad = 3) {
  Case c{op, M, N, K, 0, 0, 0, {}, {}, {}};
  const int64_t arows = op == Op::TN ? K : M, acols = op == Op::TN ? M : K;
  const int64_t brows = op == Op::NT ? N : K, bcols = op == Op::NT ? K : N;
  c.lda = acols + pad, c.ldb = bcols + pad, c.ldc = N + pad;
  Rng rng(seed);
  c.A.resize(static_cast<size_t>(std::max<int64_t>(1, arows * c.lda)));
  c.B.resize(static_cast<size_t>(std::max<int64_t>(1, brows * c.ldb)));
  c.C0.resize(static_cast<size_t>(std::max<int64_t>(1, M * c.ldc)));
  for (float& v : c.A) v = rng.normal();
  for (float& v : c.B) v = rng.normal();
  for (float& v : c.C0) v = rng.normal();
  return c;
}

// The contract, spelled out.
std::vector<float> reference(const Case& c, bool accumulate) {
  std::vector<float> C = c.C0;
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      float s = accumulate ? C[i * c.ldc + j] : 0.0f;
      for (int64_t k = 0; k < c.K; ++k) s = std::fma(c.a(i, k), c.b(k, j), s);
      C[i * c.ldc + j] = s;
    }
  return C;
}

void call(Op op, bool serial, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  using Fn = void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t,
                      float*, int64_t, bool);
  const Fn fns[2][3] = {{gemm_nt, gemm_nn, gemm_tn}, {gemm_nt_serial, gemm_nn_serial, gemm_tn_serial}};
  fns[serial][static_cast<int>(op)](M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

std::vector<float> run(const Case& c, bool accumulate, bool serial = false) {
  std::vector<float> C = c.C0;
  call(c.op, serial, c.M, c.N, c.K, c.A.data(), c.lda, c.B.data(), c.ldb, C.data(), c.ldc, accumulate);
  return C;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Index of the first differing element, for messages.
size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size();
}

// Each row of an nt product against the same row computed alone (gemm_nt of one row: the skinny
// path), bitwise.
::testing::AssertionResult rows_match_rows_alone(const Case& c, const std::vector<float>& got,
                                                 bool accumulate) {
  for (int64_t i = 0; i < c.M; ++i) {
    std::vector<float> row(c.C0.begin() + i * c.ldc, c.C0.begin() + i * c.ldc + c.N);
    gemm_nt(1, c.N, c.K, c.A.data() + i * c.lda, c.lda, c.B.data(), c.ldb, row.data(), c.N,
            accumulate);
    if (std::memcmp(row.data(), got.data() + i * c.ldc, row.size() * sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "row " << i << " differs from the row alone";
  }
  return ::testing::AssertionSuccess();
}

// Shapes around every block edge of the kernels: register tiles (6/12 rows, 16/32 columns; last
// panels of at most one vector, 8/16 columns, run a one-vector tile), row blocks of 48/96, K
// blocks (≤ 320 on AVX2, ≤ 512 on AVX-512, split evenly), B blocks of 512/1024 columns,
// one-element and empty-remainder cases, the skinny (M <= 4) nt path and the few-row nt path (up
// to 16/32 rows; nn's few-row path needs a B larger than the L2: FewRowsReadTheWeightsInPlace).
const std::vector<std::array<int64_t, 3>> kShapes = {
    {1, 1, 1},     {1, 17, 5},    {7, 13, 5},    {12, 32, 320},  {13, 33, 321}, {6, 16, 300},
    {12, 32, 512}, {13, 33, 513},
    {25, 100, 64}, {37, 70, 641}, {3, 600, 40},  {100, 1, 77},   {64, 520, 33}, {2, 1030, 9},
    {97, 47, 1000}, {49, 1025, 17}, {4, 37, 1000}, {2, 9, 17}, {3, 16, 16}, {4, 300, 33}};

}  // namespace

TEST(Gemm, EveryLayoutIsTheFmaChainBitwiseOnEveryTarget) {
  for_each_simd_target([](simd::Target) {
    uint64_t seed = 1;
    for (Op op : {Op::NT, Op::NN, Op::TN})
      for (const auto& [M, N, K] : kShapes)
        for (bool accumulate : {false, true})
          for (bool serial : {false, true}) {
            const Case c = make_case(op, M, N, K, seed++);
            const auto want = reference(c, accumulate);
            const auto got = run(c, accumulate, serial);
            ASSERT_TRUE(same_bits(got, want))
                << op_name(op) << " M=" << M << " N=" << N << " K=" << K << " accumulate=" << accumulate
                << " serial=" << serial << " first difference at " << first_difference(got, want);
          }
  });
}

TEST(Gemm, ARowsReadInPlaceOrCopiedAreTheSameChain) {
  // nt/nn read A's rows in place unless the row stride is near a multiple of 4 KiB (a stride of
  // 1,024 floats puts all of a micro-panel's rows in one L1 set), where they copy them first:
  // both ways, in K blocks and with partial tiles, against the spelled-out chain.
  for_each_simd_target([](simd::Target) {
    uint64_t seed = 100;
    for (Op op : {Op::NT, Op::NN, Op::TN})
      for (int64_t pad : {3, 24, 1048})  // A's stride 1,003 (in place), 1,024, 2,048 (copied)
        for (bool accumulate : {false, true}) {
          const Case c = make_case(op, 37, 70, 1000, seed++, pad);
          ASSERT_TRUE(same_bits(run(c, accumulate), reference(c, accumulate)))
              << op_name(op) << " lda=" << c.lda << " accumulate=" << accumulate;
        }
  });
}

TEST(Gemm, RowAloneEqualsRowInsideAThousandRowCall) {
  // For every entry point: a row of C computed in a call of 1 row is the same row of a call of
  // 1,000 rows (for tn, the rows are A's columns), bitwise, on every target.
  for_each_simd_target([](simd::Target) {
    for (Op op : {Op::NT, Op::NN, Op::TN})
      for (bool serial : {false, true}) {
        const Case c = make_case(op, 1000, 150, 300, 7, 0);
        const auto all = run(c, false, serial);
        for (int64_t i : {0, 1, 11, 12, 13, 500, 997, 999}) {
          std::vector<float> row(static_cast<size_t>(c.N), -1.0f);
          const float* a = op == Op::TN ? c.A.data() + i : c.A.data() + i * c.lda;
          call(op, serial, 1, c.N, c.K, a, c.lda, c.B.data(), c.ldb, row.data(), c.N, false);
          ASSERT_EQ(std::memcmp(row.data(), all.data() + i * c.ldc, row.size() * sizeof(float)), 0)
              << op_name(op) << " serial=" << serial << " row " << i;
        }
      }
  });
}

TEST(Gemm, SameBitsForAnyThreadCount) {
  const int before = num_threads();
  for (Op op : {Op::NT, Op::NN, Op::TN}) {
    const Case c = make_case(op, 257, 300, 129, 11);
    set_num_threads(1);
    const auto one = run(c, true);
    for (int t : {2, 3, 7}) {
      set_num_threads(t);
      EXPECT_TRUE(same_bits(run(c, true), one)) << op_name(op) << " threads " << t;
    }
  }
  set_num_threads(before);
}

TEST(Gemm, TallRowBlocksAndTheirTailAreTheFmaChain) {
  // Packed B of 4.5 MiB (over half of any L2 these machines have) makes the head's row blocks
  // tall and the last rows short blocks in column parts; A's stride 1,100 is read in place and
  // 2,048 through copied panels. Sampled rows against the chain, and the whole product the same
  // at 1, 2 and 3 threads and serial, on every vector target (the scalar target has no blocks,
  // and its chain over these shapes takes seconds).
  const int before = num_threads();
  for_each_simd_target([](simd::Target t) {
    if (t == simd::Target::Scalar) return;
    for (Op op : {Op::NT, Op::NN, Op::TN})
      for (int64_t pad : {0, 948}) {
        const Case c = make_case(op, 450, 1030, 1100, 31, pad);
        set_num_threads(1);
        const auto one = run(c, true);
        for (int64_t i : {0, 11, 12, 191, 192, 257, 449})
          for (int64_t j : {0, 31, 32, 1023, 1024, 1029}) {
            float s = c.C0[i * c.ldc + j];
            for (int64_t k = 0; k < c.K; ++k) s = std::fma(c.a(i, k), c.b(k, j), s);
            ASSERT_EQ(std::memcmp(&s, &one[i * c.ldc + j], sizeof s), 0)
                << op_name(op) << " lda=" << c.lda << " C(" << i << ", " << j << ")";
          }
        for (int threads : {2, 3}) {
          set_num_threads(threads);
          ASSERT_TRUE(same_bits(run(c, true), one))
              << op_name(op) << " lda=" << c.lda << " threads " << threads;
        }
        ASSERT_TRUE(same_bits(run(c, true, true), one))
            << op_name(op) << " lda=" << c.lda << " serial";
      }
  });
  set_num_threads(before);
}

TEST(Gemm, FewRowsAgainstLargeWeightsRunTransposedWithTheSameBits) {
  // nt with 17-256 rows (33-256 on AVX-512) against weights whose packed copy overflows half the
  // L2 (4.5 MiB here) computes Cᵀ = B·Aᵀ and transposes C tiles on their way out. Every row
  // against the same row computed alone (the skinny path), sampled elements against the chain,
  // and the whole product the same at 1, 2 and 3 threads and serial; with A's rows in place
  // (stride 1,100) and copied (2,048), partial panels (20, 45, 100 rows) and partial
  // micro-panels (1,030 weight rows).
  const int before = num_threads();
  for_each_simd_target([](simd::Target t) {
    if (t == simd::Target::Scalar) return;
    uint64_t seed = 300;
    for (int64_t M : {20, 45, 100, 256})
      for (int64_t pad : {0, 948})
        for (bool accumulate : {false, true}) {
          const Case c = make_case(Op::NT, M, 1030, 1100, seed++, pad);
          set_num_threads(1);
          const auto one = run(c, accumulate);
          ASSERT_TRUE(rows_match_rows_alone(c, one, accumulate))
              << "M=" << M << " lda=" << c.lda << " accumulate=" << accumulate;
          for (int64_t i : {int64_t{0}, M / 2, M - 1})
            for (int64_t j : {0, 11, 12, 1019, 1020, 1029}) {
              float s = accumulate ? c.C0[i * c.ldc + j] : 0.0f;
              for (int64_t k = 0; k < c.K; ++k) s = std::fma(c.a(i, k), c.b(k, j), s);
              ASSERT_EQ(std::memcmp(&s, &one[i * c.ldc + j], sizeof s), 0)
                  << "M=" << M << " lda=" << c.lda << " C(" << i << ", " << j << ")";
            }
          for (int threads : {2, 3}) {
            set_num_threads(threads);
            ASSERT_TRUE(same_bits(run(c, accumulate), one)) << "M=" << M << " threads " << threads;
          }
          ASSERT_TRUE(same_bits(run(c, accumulate, true), one)) << "M=" << M << " serial";
        }
    // A contraction longer than a slice (4,096 on AVX-512, 8,192 on AVX2) continues the
    // transposed chains through C; rows alone take the skinny path, which has no slices.
    const Case c = make_case(Op::NT, 40, 300, 9000, 29, 1);
    for (bool accumulate : {false, true})
      ASSERT_TRUE(rows_match_rows_alone(c, run(c, accumulate, true), accumulate))
          << "K=9000 accumulate=" << accumulate;
  });
  set_num_threads(before);
}

TEST(Gemm, FewRowsReadTheWeightsInPlaceWithTheSameBits) {
  // nt with 5 to kNr rows (16 on AVX2, 32 on AVX-512) broadcasts W's rows in place against a
  // k-major copy of x, six W rows at a time; nn with 1 to 12 rows (24 on AVX-512) reads B's rows
  // in place in blocks of 16, in one or two row groups, where B overflows the L2. Against the
  // chain: 1-32 rows (one and two vectors of rows for nt, row groups of 1-6 for nn, and the
  // packed paths past them), a weight stride of 1,024 floats (nt: the rows share an L1 set, so
  // the next rows are fetched half a row on) and of 1,103, K = 4,200 (nt: xt in slices, the
  // chains continuing through C), and for nn 1-25 rows and K = 16,000 (B of 2.4 MB, over any L2
  // here; K = 1,100 packs), 37 weight rows or columns (partial groups and tiles); serial, on one
  // thread and on two. Then 1,031 weight rows (nt), 1,000 columns at a stride of 1,024 (nn,
  // 2.8 MB) and 1-4 rows against 800 × 800 (nn: whole one- to four-row tiles) over 1-3 threads.
  const int before = num_threads();
  for_each_simd_target([](simd::Target) {
    uint64_t seed = 500;
    using KPad = std::vector<std::pair<int64_t, int64_t>>;
    using Rows = std::vector<int64_t>;
    for (Op op : {Op::NT, Op::NN})
      for (int64_t M : op == Op::NT ? Rows{1, 3, 5, 8, 9, 13, 16, 17, 32}
                                    : Rows{1, 5, 7, 12, 13, 25})
        for (const auto& [K, pad] : op == Op::NT ? KPad{{1000, 24}, {1100, 3}, {4200, 0}}
                                                 : KPad{{1100, 3}, {16000, 0}})
          for (bool accumulate : {false, true}) {
            const Case c = make_case(op, M, 37, K, seed++, pad);
            const auto want = reference(c, accumulate);
            set_num_threads(1);
            const auto got = run(c, accumulate);
            ASSERT_TRUE(same_bits(got, want))
                << op_name(op) << " M=" << M << " K=" << K << " ldb=" << c.ldb
                << " accumulate=" << accumulate
                << " first difference at " << first_difference(got, want);
            ASSERT_TRUE(same_bits(run(c, accumulate, true), want))
                << op_name(op) << " M=" << M << " K=" << K << " serial";
            set_num_threads(2);
            ASSERT_TRUE(same_bits(run(c, accumulate), want))
                << op_name(op) << " M=" << M << " K=" << K << " threads 2";
          }
    const Case nt = make_case(Op::NT, 12, 1031, 1000, 77, 24);
    std::vector<Case> nn = {make_case(Op::NN, 12, 1000, 700, 78, 24)};
    for (int64_t M : {1, 2, 3, 4})  // whole tiles of 1-4 rows (96, 48, 32, 24 columns on AVX2)
      nn.push_back(make_case(Op::NN, M, 800, 800, 79 + M, 0));
    std::vector<std::vector<float>> nn_want;
    for (const Case& c : nn) nn_want.push_back(reference(c, true));
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      ASSERT_TRUE(rows_match_rows_alone(nt, run(nt, true), true)) << "nt threads " << threads;
      for (size_t q = 0; q < nn.size(); ++q)
        ASSERT_TRUE(same_bits(run(nn[q], true), nn_want[q]))
            << "nn M=" << nn[q].M << " N=" << nn[q].N << " threads " << threads;
    }
  });
  set_num_threads(before);
}

TEST(Gemm, AccumulatingContinuesTheChain) {
  // dW over K1 rows then K2 more rows equals one call over K1 + K2 (gradient accumulation over
  // micro-batches is bitwise one big batch).
  const Case c = make_case(Op::TN, 40, 50, 300, 13, 0);
  const auto whole = run(c, false);
  std::vector<float> C = c.C0;
  gemm_tn(c.M, c.N, 100, c.A.data(), c.lda, c.B.data(), c.ldb, C.data(), c.ldc, false);
  gemm_tn(c.M, c.N, 200, c.A.data() + 100 * c.lda, c.lda, c.B.data() + 100 * c.ldb, c.ldb, C.data(), c.ldc, true);
  EXPECT_TRUE(same_bits(C, whole));
}

TEST(Gemm, LongContractionsRunInSlicesWithTheSameBits) {
  // K beyond one slice (4,096 on AVX-512, 8,192 on AVX2): the chains continue through C.
  for_each_simd_target([](simd::Target) {
    for (Op op : {Op::NT, Op::TN}) {
      const Case c = make_case(op, 13, 40, 9000, 23, 1);
      for (bool accumulate : {false, true})
        ASSERT_TRUE(same_bits(run(c, accumulate), reference(c, accumulate))) << op_name(op);
    }
  });
}

TEST(Gemm, ProducedRowsOfBAreTheSameChain) {
  // gemm_nn_serial_rows: B's rows come from a producer (MXFP4 weights decoded as they are
  // packed), each asked for once per packing with its absolute k. Every shape edge above, and a
  // K beyond one slice (the rows' k then starts past 0 in each slice).
  struct Producer {
    const Case* c;
    int64_t calls = 0;
    static void row(const void* ctx, int64_t k, int64_t j0, int64_t n, float* out) {
      auto* self = const_cast<Producer*>(static_cast<const Producer*>(ctx));
      ASSERT_TRUE(k >= 0 && k < self->c->K && j0 >= 0 && n > 0 && j0 + n <= self->c->N &&
                  n <= kGemmRowsMaxFloats)
          << k << " " << j0 << " " << n;
      std::memcpy(out, self->c->B.data() + k * self->c->ldb + j0, sizeof(float) * static_cast<size_t>(n));
      ++self->calls;
    }
  };
  std::vector<std::array<int64_t, 3>> shapes = kShapes;
  shapes.push_back({13, 40, 9000});
  shapes.push_back({7, 40, 16000});  // nn's few-row path (B of 2.6 MB, over any L2 here)
  for_each_simd_target([&](simd::Target) {
    for (const auto& [M, N, K] : shapes) {
      const Case c = make_case(Op::NN, M, N, K, 37 + static_cast<uint64_t>(M * N + K), 2);
      for (bool accumulate : {false, true}) {
        Producer producer{&c};
        const GemmRows rows{&Producer::row, &producer};
        std::vector<float> C = c.C0;
        gemm_nn_serial_rows(c.M, c.N, c.K, c.A.data(), c.lda, rows, C.data(), c.ldc, accumulate);
        ASSERT_TRUE(same_bits(C, run(c, accumulate, /*serial=*/true)))
            << M << " x " << N << " x " << K << " acc " << accumulate << " at "
            << first_difference(C, run(c, accumulate, true));
        EXPECT_GT(producer.calls, 0);
      }
    }
  });
}

TEST(Gemm, MatchesDoubleReference) {
  // Not only self-consistent: close to the exact product.
  const Case c = make_case(Op::NN, 33, 47, 700, 17, 0);
  const auto got = run(c, false);
  std::vector<double> want(got.size());
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < c.K; ++k) s += static_cast<double>(c.a(i, k)) * c.b(k, j);
      want[static_cast<size_t>(i * c.ldc + j)] = s;
    }
  EXPECT_LT(rel_error(got.data(), want.data(), static_cast<int64_t>(got.size())), 1e-6);
}

TEST(Gemm, NonFiniteValuesPropagateAsInTheChain) {
  for_each_simd_target([](simd::Target) {
    Case c = make_case(Op::NT, 20, 40, 50, 19, 1);
    c.A[3 * c.lda + 7] = std::numeric_limits<float>::infinity();
    c.B[5 * c.ldb + 7] = 0.0f;  // inf·0 = NaN in one element
    c.B[9 * c.ldb + 2] = std::numeric_limits<float>::quiet_NaN();
    c.A[11 * c.lda + 4] = 1e-40f;  // subnormal
    const auto want = reference(c, false);
    EXPECT_TRUE(same_bits(run(c, false), want));
  });
}

TEST(Gemm, EmptyContractionClearsOrKeeps) {
  std::vector<float> C(6, 3.0f);
  gemm_nt(2, 3, 0, nullptr, 0, nullptr, 0, C.data(), 3, /*accumulate=*/true);
  EXPECT_EQ(C[5], 3.0f);
  gemm_nt(2, 3, 0, nullptr, 0, nullptr, 0, C.data(), 3, /*accumulate=*/false);
  EXPECT_EQ(C[5], 0.0f);
  gemm_tn(0, 3, 4, nullptr, 0, nullptr, 0, C.data(), 3, false);  // M = 0: nothing written
}

TEST(Simd, ForcedTargetsAndErrors) {
  EXPECT_EQ(simd::parse("avx2", "x"), simd::Target::Avx2);
  EXPECT_THROW(simd::parse("sse9", "--simd"), Error);
  try {
    simd::parse("sse9", "--simd");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--simd"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("avx512, avx2 or scalar"), std::string::npos);
  }
  const auto all = simd::supported();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.back(), simd::Target::Scalar);
  const simd::Target before = simd::current();
  for (simd::Target t : all) {
    simd::select(t);
    EXPECT_EQ(simd::current(), t);
  }
  simd::select(before);
}
