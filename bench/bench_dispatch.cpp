// Expert-parallel dispatch + combine against raw MPI_Alltoallv (issue 4): throughput of
// AllToAllDispatcher::dispatch followed by combine(Pass::Inference), as a ratio to two
// MPI_Alltoallv calls that move exactly the same rows between the same ranks from pre-allocated
// buffers. The dispatcher's time includes what the raw exchange leaves out (count exchange,
// counting sorts, packing and unpacking copies, buffer allocation, the slot sum), which is the
// overhead this benchmark exists to expose; the target is ratio >= 0.8.
//
// Every figure is the median over iterations of the slowest rank's time (an exchange is only
// done when its last rank is): raw ms / d+c ms for the two measurements, disp ms for the
// dispatch half of d+c; GB/s is the mean bytes one rank moves per iteration (both directions,
// its rows to itself included) over that time, ratio = raw ms / d+c ms, tokens/s counts every
// rank's tokens.
//
// Run under mpirun (bench/dispatch_vs_alltoallv.sh does np 1, 2, 4):
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -np 2 build/bench/bench_dispatch --tokens 4096
// Own main instead of Google Benchmark's: MPI must be initialised before anything else, and
// every rank has to run the same iterations in lockstep, which Google Benchmark's adaptive
// iteration count would not guarantee.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fmt/format.h>
#include <memory>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "parallel/all_to_all_dispatcher.h"
#include "parallel/communicator.h"

using namespace moe;

namespace {

struct Options {
  int64_t tokens = 4096, dim = 1024, experts = 64, top_k = 6;
  int iters = 20, warmup = 3, threads = 1;
  uint64_t seed = 1;
  bool header = true;
};

void mpi_ok(int rc, const char* call) {
  if (rc != MPI_SUCCESS) fail("{} failed with MPI error {}", call, rc);
}

struct Inputs {
  Tensor x, ids, weights;
};

// Random top-k routing: k distinct experts per token, every k-subset equally likely, and
// uniform weights. Each rank draws its own stream so the per-destination counts differ between
// ranks the way real batches do.
Inputs make_inputs(const Options& o, int rank) {
  Rng rng(splitmix64(o.seed) + static_cast<uint64_t>(rank));
  Inputs in;
  in.x = Tensor::empty({o.tokens, o.dim}, DType::F32, MemCategory::Activations);
  in.ids = Tensor::empty({o.tokens, o.top_k}, DType::I32, MemCategory::Routing);
  in.weights = Tensor::empty({o.tokens, o.top_k}, DType::F32, MemCategory::Routing);
  float* x = in.x.f32();
  for (int64_t i = 0; i < in.x.numel(); ++i) x[i] = rng.uniform() - 0.5f;
  // Partial Fisher-Yates over a permutation kept across tokens: whatever order earlier tokens
  // left it in, the first k after k swaps are a uniform k-subset.
  std::vector<int32_t> perm(static_cast<size_t>(o.experts));
  std::iota(perm.begin(), perm.end(), 0);
  int32_t* id = in.ids.i32();
  float* w = in.weights.f32();
  for (int64_t t = 0; t < o.tokens; ++t)
    for (int64_t j = 0; j < o.top_k; ++j) {
      const uint64_t left = static_cast<uint64_t>(o.experts - j);
      const int64_t pick = j + static_cast<int64_t>(rng.next_u64() % left);
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(pick)]);
      id[t * o.top_k + j] = perm[static_cast<size_t>(j)];
      w[t * o.top_k + j] = rng.uniform();
    }
  return in;
}

// The two exchanges the dispatcher's all_to_all_v calls make, with the same per-rank row
// counts, row widths and row datatype, but nothing around them and buffers allocated (and
// faulted in) once.
class RawExchange {
 public:
  RawExchange(const Options& o, const Tensor& ids, int np) : np_(np) {
    const int64_t per = o.experts / np, slots = o.tokens * o.top_k;
    send_.assign(static_cast<size_t>(np), 0);
    const int32_t* id = ids.i32();
    for (int64_t s = 0; s < slots; ++s) ++send_[static_cast<size_t>(id[s] / per)];
    recv_.assign(static_cast<size_t>(np), 0);
    mpi_ok(MPI_Alltoall(send_.data(), 1, MPI_INT, recv_.data(), 1, MPI_INT, MPI_COMM_WORLD),
           "MPI_Alltoall (row counts)");
    send_displ_ = prefix(send_);
    recv_displ_ = prefix(recv_);
    rows_ = std::accumulate(recv_.begin(), recv_.end(), int64_t{0});
    // Dispatch rows carry the routing weight as one extra column; combine returns bare rows.
    mpi_ok(MPI_Type_contiguous(static_cast<int>(o.dim + 1), MPI_FLOAT, &dispatch_row_),
           "MPI_Type_contiguous");
    mpi_ok(MPI_Type_commit(&dispatch_row_), "MPI_Type_commit");
    mpi_ok(MPI_Type_contiguous(static_cast<int>(o.dim), MPI_FLOAT, &combine_row_),
           "MPI_Type_contiguous");
    mpi_ok(MPI_Type_commit(&combine_row_), "MPI_Type_commit");
    dispatch_send_ = filled({slots, o.dim + 1});
    dispatch_recv_ = filled({rows_, o.dim + 1});
    combine_send_ = filled({rows_, o.dim});
    combine_recv_ = filled({slots, o.dim});
  }
  ~RawExchange() {
    MPI_Type_free(&dispatch_row_);
    MPI_Type_free(&combine_row_);
  }
  RawExchange(const RawExchange&) = delete;
  RawExchange& operator=(const RawExchange&) = delete;

  // Rows this rank's experts receive (the dispatcher's R).
  int64_t rows() const { return rows_; }

  void run() {
    mpi_ok(MPI_Alltoallv(dispatch_send_.raw(), send_.data(), send_displ_.data(), dispatch_row_,
                         dispatch_recv_.raw(), recv_.data(), recv_displ_.data(), dispatch_row_,
                         MPI_COMM_WORLD),
           "MPI_Alltoallv (dispatch direction)");
    mpi_ok(MPI_Alltoallv(combine_send_.raw(), recv_.data(), recv_displ_.data(), combine_row_,
                         combine_recv_.raw(), send_.data(), send_displ_.data(), combine_row_,
                         MPI_COMM_WORLD),
           "MPI_Alltoallv (combine direction)");
  }

 private:
  std::vector<int> prefix(const std::vector<int>& counts) const {
    std::vector<int> d(static_cast<size_t>(np_), 0);
    for (size_t j = 1; j < d.size(); ++j) d[j] = d[j - 1] + counts[j - 1];
    return d;
  }
  static Tensor filled(const Shape& shape) {
    Tensor t = Tensor::empty(shape, DType::F32, MemCategory::Scratch);
    t.zero();  // fault the pages in now, not inside the first timed exchange
    return t;
  }

  int np_;
  std::vector<int> send_, recv_, send_displ_, recv_displ_;
  int64_t rows_ = 0;
  MPI_Datatype dispatch_row_ = MPI_DATATYPE_NULL, combine_row_ = MPI_DATATYPE_NULL;
  Tensor dispatch_send_, dispatch_recv_, combine_send_, combine_recv_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int run(const Options& o) {
  std::shared_ptr<Communicator> world = make_world_communicator();
  const int rank = world->rank(), np = world->size();
  MOE_CHECK(o.tokens > 0 && o.dim > 0 && o.iters > 0 && o.warmup >= 0 && o.threads > 0,
            "--tokens, --dim, --iters and --threads must be positive, --warmup non-negative");
  MOE_CHECK(o.top_k >= 1 && o.top_k <= o.experts, "--top-k {} must be in [1, --experts {}]",
            o.top_k, o.experts);
  set_num_threads(o.threads);

  AllToAllDispatcher dispatcher(world);
  dispatcher.local_experts(o.experts);  // rejects an expert count that does not split over np
  const Inputs in = make_inputs(o, rank);
  RawExchange raw(o, in.ids, np);

  int64_t dispatched_rows = -1;
  auto dispatch_combine = [&](double& t_dispatch) {
    const double t0 = MPI_Wtime();
    Dispatched d = dispatcher.dispatch(in.x, in.ids, in.weights, o.experts);
    t_dispatch = MPI_Wtime() - t0;
    dispatched_rows = d.rows.dim(0);
    Tensor y = dispatcher.combine(d.rows, d.handle, Pass::Inference);
    MOE_CHECK(!d.handle.live(), "combine(Pass::Inference) kept the handle alive");
  };
  // Barrier first so every rank starts together and the max over ranks is the exchange's time,
  // not one rank's late arrival.
  auto timed = [&](auto&& body) {
    world->barrier();
    const double t0 = MPI_Wtime();
    body();
    return MPI_Wtime() - t0;
  };

  std::vector<double> raw_s, ep_s, dispatch_s;
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    // [raw, dispatch + combine, dispatch alone]; the order alternates so a slow phase of the
    // machine (another tenant, page cache) hits both measurements alike.
    double t[3] = {0, 0, 0};
    auto raw_once = [&] { t[0] = timed([&] { raw.run(); }); };
    auto ep_once = [&] { t[1] = timed([&] { dispatch_combine(t[2]); }); };
    if (it % 2 == 0) raw_once(), ep_once();
    else ep_once(), raw_once();
    mpi_ok(MPI_Allreduce(MPI_IN_PLACE, t, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
           "MPI_Allreduce (timings)");
    MOE_CHECK(dispatched_rows == raw.rows(),
              "the dispatcher received {} rows but the raw exchange {}: the baseline would not "
              "move the same bytes",
              dispatched_rows, raw.rows());
    if (it >= o.warmup) raw_s.push_back(t[0]), ep_s.push_back(t[1]), dispatch_s.push_back(t[2]);
  }

  // Every slot is sent once and, summed over ranks, received once, so the mean per rank is
  // exact: T·k rows of dim + 1 floats out, T·k rows of dim floats back (rows a rank keeps for
  // itself included: MPI copies them too).
  const double bytes = 4.0 * static_cast<double>(o.tokens * o.top_k * (2 * o.dim + 1));
  const double t_raw = median(raw_s), t_ep = median(ep_s), t_disp = median(dispatch_s);
  if (rank == 0) {
    if (o.header) {
      fmt::print("dispatch+combine vs MPI_Alltoallv: dim {}, {} experts, top-{}, {} tokens/rank, "
                 "{} threads/rank, median of {} iterations (max over ranks) after {} warm-up; "
                 "tokens/s counts all ranks' tokens\n",
                 o.dim, o.experts, o.top_k, o.tokens, o.threads, o.iters, o.warmup);
      fmt::print("{:>3} {:>12} {:>8} {:>9} {:>8} {:>8} {:>9} {:>6} {:>10}\n", "np",
                 "MB/rank/iter", "raw ms", "raw GB/s", "d+c ms", "disp ms", "d+c GB/s", "ratio",
                 "tokens/s");
    }
    fmt::print("{:>3} {:>12.1f} {:>8.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:>9.2f} {:>6.3f} {:>10.0f}\n",
               np, bytes * 1e-6, t_raw * 1e3, bytes / t_raw * 1e-9, t_ep * 1e3, t_disp * 1e3,
               bytes / t_ep * 1e-9, t_raw / t_ep, static_cast<double>(np * o.tokens) / t_ep);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(&argc, &argv);
  CLI::App app{"expert-parallel dispatch + combine vs raw MPI_Alltoallv of the same bytes"};
  Options o;
  app.add_option("--tokens", o.tokens, "tokens per rank");
  app.add_option("--dim", o.dim, "hidden size (floats per row)");
  app.add_option("--experts", o.experts, "routed experts (divisible by the number of ranks)");
  app.add_option("--top-k", o.top_k, "experts per token");
  app.add_option("--iters", o.iters, "timed iterations of each measurement");
  app.add_option("--warmup", o.warmup, "untimed iterations first");
  app.add_option("--seed", o.seed, "routing and data seed (each rank offsets it by its rank)");
  app.add_option("--threads", o.threads, "OpenMP threads per rank");
  app.add_flag("!--no-header", o.header, "print only the result row (for multi-run tables)");
  CLI11_PARSE(app, argc, argv);
  return run_or_abort([&] { return run(o); });
}
