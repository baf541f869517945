#include "parallel/communicator.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <vector>

#include "core/error.h"
#include "parallel/collective_watchdog.h"

namespace moe {

// ------------------------------------------------------------------ local

void LocalCommunicator::all_to_all(const int64_t* send, int64_t* recv, int64_t n) {
  if (n > 0 && send != recv) std::memmove(recv, send, sizeof(int64_t) * static_cast<size_t>(n));
}

void LocalCommunicator::all_to_all_v(const float* send, const int64_t* send_rows, float* recv,
                                     const int64_t* recv_rows, int64_t row_width) {
  MOE_CHECK(send_rows[0] == recv_rows[0] && send_rows[0] >= 0,
            "all_to_all_v: one rank sends {} rows to itself but expects {}", send_rows[0],
            recv_rows[0]);
  const int64_t n = send_rows[0] * row_width;
  if (n > 0 && send != recv) std::memmove(recv, send, sizeof(float) * static_cast<size_t>(n));
}

void RowRuns::add(int32_t row, int32_t n) {
  if (n <= 0) return;
  if (!first.empty() && first.back() + count.back() == row) {
    count.back() += n;
    return;
  }
  first.push_back(row);
  count.push_back(n);
}

int64_t RowRuns::rows() const {
  int64_t n = 0;
  for (int32_t c : count) n += c;
  return n;
}

namespace {

// Copies the rows named by `src_runs` of `src` into the rows named by `dst_runs` of `dst`, in
// order (the two may cut the same rows into different runs).
void copy_runs(const float* src, const RowRuns& src_runs, float* dst, const RowRuns& dst_runs,
               int64_t width) {
  size_t i = 0, j = 0;
  int64_t si = 0, dj = 0;  // rows already used of run i / run j
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(width);
  while (i < src_runs.first.size() && j < dst_runs.first.size()) {
    const int64_t n = std::min<int64_t>(src_runs.count[i] - si, dst_runs.count[j] - dj);
    std::memcpy(dst + (dst_runs.first[j] + dj) * width, src + (src_runs.first[i] + si) * width,
                row_bytes * static_cast<size_t>(n));
    si += n, dj += n;
    if (si == src_runs.count[i]) ++i, si = 0;
    if (dj == dst_runs.count[j]) ++j, dj = 0;
  }
}

}  // namespace

void LocalCommunicator::all_to_all_rows(const float* send, const std::vector<RowRuns>& to,
                                        float* recv, const std::vector<RowRuns>& from,
                                        int64_t row_width) {
  MOE_CHECK(to.size() == 1 && from.size() == 1 && to[0].rows() == from[0].rows(),
            "all_to_all_rows: one rank sends {} rows to itself but expects {}",
            to.empty() ? 0 : to[0].rows(), from.empty() ? 0 : from[0].rows());
  copy_runs(send, to[0], recv, from[0], row_width);
}

std::unique_ptr<Communicator> LocalCommunicator::split(int, int) {
  return std::make_unique<LocalCommunicator>();
}

void LocalCommunicator::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

// ------------------------------------------------------------------ MPI runtime

namespace {

bool g_we_initialized = false;

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) std::snprintf(msg, sizeof msg, "code %d", rc);
  fail("{} failed: {}", call, msg);
}

// A blocking collective, timed by the collective watchdog while it runs; returns its MPI code
// (callers free their datatypes before checking it).
template <typename Call>
int timed_collective(const char* what, Call&& call) {
  const CollectiveWait wait(what);
  return call();
}

// The same, checked: an error names `what`.
template <typename Call>
void collective(const char* what, Call&& call) {
  mpi_check(timed_collective(what, call), what);
}

int to_int(int64_t v, const char* what) {
  MOE_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(),
            "{} = {} does not fit MPI's 32-bit count (larger exchanges are not supported: split "
            "the batch)",
            what, v);
  return static_cast<int>(v);
}

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

bool mpi_initialized() {
  int i = 0;
  MPI_Initialized(&i);
  return i != 0;
}

}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  if (mpi_initialized()) return;  // someone else owns MPI's lifetime
  int provided = 0;
  mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  g_we_initialized = true;
  // Errors come back as codes (turned into moe::Error) instead of MPI's default abort, so the
  // message names the call; run_or_abort then ends the job.
  mpi_check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  MOE_CHECK(provided >= MPI_THREAD_FUNNELED,
            "MPI_Init_thread: the MPI library gives thread level {}, need MPI_THREAD_FUNNELED",
            provided);
}

MpiRuntime::~MpiRuntime() {
  if (!g_we_initialized || mpi_finalized()) return;
  if (std::uncaught_exceptions() > 0) {
    // Unwinding: the other ranks may sit in a collective this rank will not join, and
    // MPI_Finalize would wait for them. End the whole job instead.
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::fprintf(stderr, "rank %d: an exception is unwinding past MpiRuntime: aborting all ranks\n",
                 rank);
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }
  MPI_Finalize();
  g_we_initialized = false;
}

bool MpiRuntime::active() { return mpi_initialized() && !mpi_finalized(); }

bool MpiRuntime::launched_by_mpirun() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v)) return true;
  return false;
}

// ------------------------------------------------------------------ MPI communicator

struct MpiCommunicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owned = false;  // created by split: freed by us
};

MpiCommunicator::MpiCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  mpi_check(MPI_Comm_rank(impl_->comm, &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(impl_->comm, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  if (impl_ && impl_->owned && impl_->comm != MPI_COMM_NULL && !mpi_finalized())
    MPI_Comm_free(&impl_->comm);
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::world() {
  MOE_CHECK(MpiRuntime::active(), "MpiCommunicator::world: MPI is not initialised (construct an "
                                  "MpiRuntime at the start of main)");
  auto impl = std::make_unique<Impl>();
  impl->comm = MPI_COMM_WORLD;
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(impl)));
}

std::string MpiCommunicator::name() const { return "mpi(" + std::to_string(size_) + ")"; }

void MpiCommunicator::barrier() {
  collective("MPI_Barrier", [&] { return MPI_Barrier(impl_->comm); });
}

namespace {

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}
template <>
MPI_Datatype mpi_type<int64_t>() {
  return MPI_INT64_T;
}

// Reduce-scatter by all-to-all (each rank owns one slice of each chunk and adds the W copies in
// rank order), then all-gather of the reduced slices: deterministic, bandwidth-optimal, and the
// scratch is bounded by the chunk size.
template <typename T>
void deterministic_sum(MPI_Comm comm, int rank, int size, T* data, int64_t n, int64_t chunk) {
  if (size == 1 || n == 0) return;
  const MPI_Datatype type = mpi_type<T>();
  std::vector<int> counts(static_cast<size_t>(size)), displs(static_cast<size_t>(size));
  std::vector<int> rcounts(static_cast<size_t>(size)), rdispls(static_cast<size_t>(size));
  std::vector<T> recv, acc;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t nc = std::min(chunk, n - c0);
    T* d = data + c0;
    for (int j = 0; j < size; ++j) {
      const int64_t b = nc * j / size, e = nc * (j + 1) / size;
      counts[static_cast<size_t>(j)] = static_cast<int>(e - b);
      displs[static_cast<size_t>(j)] = static_cast<int>(b);
    }
    const int mine = counts[static_cast<size_t>(rank)];
    for (int j = 0; j < size; ++j) {
      rcounts[static_cast<size_t>(j)] = mine;
      rdispls[static_cast<size_t>(j)] = mine * j;
    }
    recv.resize(static_cast<size_t>(mine) * static_cast<size_t>(size));
    collective("MPI_Alltoallv (all_reduce_sum)", [&] {
      return MPI_Alltoallv(d, counts.data(), displs.data(), type, recv.data(), rcounts.data(),
                           rdispls.data(), type, comm);
    });
    acc.assign(recv.begin(), recv.begin() + mine);
    for (int r = 1; r < size; ++r) {
      const T* src = recv.data() + static_cast<size_t>(r) * static_cast<size_t>(mine);
      for (int i = 0; i < mine; ++i) acc[static_cast<size_t>(i)] += src[i];
    }
    collective("MPI_Allgatherv (all_reduce_sum)", [&] {
      return MPI_Allgatherv(acc.data(), mine, type, d, counts.data(), displs.data(), type, comm);
    });
  }
}

}  // namespace

void MpiCommunicator::all_reduce_sum(float* data, int64_t n) {
  deterministic_sum(impl_->comm, rank_, size_, data, n, kReduceChunk);
}
void MpiCommunicator::all_reduce_sum(double* data, int64_t n) {
  deterministic_sum(impl_->comm, rank_, size_, data, n, kReduceChunk);
}
void MpiCommunicator::all_reduce_sum(int64_t* data, int64_t n) {
  deterministic_sum(impl_->comm, rank_, size_, data, n, kReduceChunk);
}

void MpiCommunicator::all_reduce_min(int64_t* data, int64_t n) {
  for (int64_t c0 = 0; c0 < n; c0 += kReduceChunk) {
    const int c = static_cast<int>(std::min(kReduceChunk, n - c0));
    collective("MPI_Allreduce (all_reduce_min)", [&] {
      return MPI_Allreduce(MPI_IN_PLACE, data + c0, c, MPI_INT64_T, MPI_MIN, impl_->comm);
    });
  }
}

void MpiCommunicator::all_to_all(const int64_t* send, int64_t* recv, int64_t n) {
  const int c = to_int(n, "all_to_all: elements per rank");
  MOE_CHECK(n * size_ <= std::numeric_limits<int>::max(), "all_to_all: {} elements in all",
            n * size_);
  collective("MPI_Alltoall",
             [&] { return MPI_Alltoall(send, c, MPI_INT64_T, recv, c, MPI_INT64_T, impl_->comm); });
}

void MpiCommunicator::all_to_all_v(const float* send, const int64_t* send_rows, float* recv,
                                   const int64_t* recv_rows, int64_t row_width) {
  MOE_CHECK(row_width >= 0, "all_to_all_v: negative row width {}", row_width);
  const size_t W = static_cast<size_t>(size_);
  std::vector<int> sc(W), sd(W), rc(W), rd(W);
  int64_t so = 0, ro = 0;
  for (size_t j = 0; j < W; ++j) {
    sc[j] = to_int(send_rows[j], "all_to_all_v: rows sent to one rank");
    rc[j] = to_int(recv_rows[j], "all_to_all_v: rows received from one rank");
    sd[j] = to_int(so, "all_to_all_v: send displacement in rows");
    rd[j] = to_int(ro, "all_to_all_v: receive displacement in rows");
    so += send_rows[j];
    ro += recv_rows[j];
  }
  // Every rank has the same row width, so an empty row type is skipped everywhere alike.
  if (row_width == 0) return;
  // One datatype per row: counts and displacements are in rows, so the byte volume may exceed
  // 2^31 (the row count may not, checked above).
  MPI_Datatype row = MPI_DATATYPE_NULL;
  mpi_check(MPI_Type_contiguous(to_int(row_width, "all_to_all_v: row width"), MPI_FLOAT, &row),
            "MPI_Type_contiguous");
  mpi_check(MPI_Type_commit(&row), "MPI_Type_commit");
  const int rc_call = timed_collective("MPI_Alltoallv (all_to_all_v)", [&] {
    return MPI_Alltoallv(send, sc.data(), sd.data(), row, recv, rc.data(), rd.data(), row, impl_->comm);
  });
  MPI_Type_free(&row);
  mpi_check(rc_call, "MPI_Alltoallv");
}

void MpiCommunicator::all_to_all_rows(const float* send, const std::vector<RowRuns>& to,
                                      float* recv, const std::vector<RowRuns>& from,
                                      int64_t row_width) {
  const size_t W = static_cast<size_t>(size_);
  MOE_CHECK(to.size() == W && from.size() == W,
            "all_to_all_rows: {} send and {} receive run lists for {} ranks", to.size(),
            from.size(), W);
  if (row_width == 0) return;
  MPI_Datatype row = MPI_DATATYPE_NULL;
  mpi_check(MPI_Type_contiguous(to_int(row_width, "all_to_all_rows: row width"), MPI_FLOAT, &row),
            "MPI_Type_contiguous");
  mpi_check(MPI_Type_commit(&row), "MPI_Type_commit");
  // One indexed type per peer and direction; a peer with no rows gets count 0.
  std::vector<MPI_Datatype> st(W, row), rt(W, row);
  std::vector<int> sc(W, 0), rc(W, 0), zero(W, 0);
  auto indexed = [&](const RowRuns& runs, MPI_Datatype& type, int& count) {
    if (runs.first.empty()) return;
    mpi_check(MPI_Type_indexed(to_int(static_cast<int64_t>(runs.first.size()), "all_to_all_rows: runs"),
                               runs.count.data(), runs.first.data(), row, &type),
              "MPI_Type_indexed");
    mpi_check(MPI_Type_commit(&type), "MPI_Type_commit");
    count = 1;
  };
  for (size_t j = 0; j < W; ++j) {
    indexed(to[j], st[j], sc[j]);
    indexed(from[j], rt[j], rc[j]);
  }
  const int rc_call = timed_collective("MPI_Alltoallw (all_to_all_rows)", [&] {
    return MPI_Alltoallw(send, sc.data(), zero.data(), st.data(), recv, rc.data(), zero.data(),
                         rt.data(), impl_->comm);
  });
  for (size_t j = 0; j < W; ++j) {
    if (sc[j]) MPI_Type_free(&st[j]);
    if (rc[j]) MPI_Type_free(&rt[j]);
  }
  MPI_Type_free(&row);
  mpi_check(rc_call, "MPI_Alltoallw");
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  auto impl = std::make_unique<Impl>();
  collective("MPI_Comm_split", [&] { return MPI_Comm_split(impl_->comm, color, key, &impl->comm); });
  impl->owned = true;
  mpi_check(MPI_Comm_set_errhandler(impl->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return std::unique_ptr<Communicator>(new MpiCommunicator(std::move(impl)));
}

void MpiCommunicator::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code == 0 ? 1 : code);
  std::_Exit(code == 0 ? 1 : code);
}

std::unique_ptr<Communicator> make_world_communicator() {
  if (MpiRuntime::active()) return MpiCommunicator::world();
  return std::make_unique<LocalCommunicator>();
}

int run_or_abort(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    int rank = 0, size = 1;
    const bool mpi = MpiRuntime::active();
    if (mpi) MPI_Comm_rank(MPI_COMM_WORLD, &rank), MPI_Comm_size(MPI_COMM_WORLD, &size);
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
    std::fflush(stderr);
    if (mpi && size > 1) {
      std::fprintf(stderr, "rank %d: aborting all %d ranks\n", rank, size);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
      std::_Exit(1);
    }
    return 1;
  }
}

}  // namespace moe
