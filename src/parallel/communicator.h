#pragma once
// Collective communication for expert parallelism (SPEC §4).
//
// Communicator is the interface the dispatcher and the trainer talk to; LocalCommunicator is
// the one-rank world (no MPI at all), MpiCommunicator wraps an MPI communicator.
//
// Rules every implementation keeps:
// - Every rank calls the same collectives in the same order (the caller's contract).
// - all_reduce_sum is deterministic: each element is reduced by one rank, adding the W
//   contributions in rank order (0, 1, ..., W-1), and the result is broadcast from there. It is
//   bitwise identical on every rank and independent of arrival order, message sizes and the MPI
//   library's reduction algorithm.
// - Counts are int64 in the interface. all_to_all_v moves whole rows of `row_width` floats using
//   a contiguous row datatype, so a buffer of more than 2^31 bytes is fine as long as each
//   rank's total row count and each displacement (in rows) fit in int32; anything larger is
//   rejected with a moe::Error naming the limit. all_reduce works in bounded chunks, so any n.
// - MPI failures become moe::Error with the MPI call named (MPI_ERRORS_RETURN on every
//   communicator we create).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moe {

// Where the rows exchanged with one peer live in a buffer: run i is rows first[i] ..
// first[i] + count[i] - 1, and the runs are taken (or filled) in order. Row indices are int32,
// like MPI's displacements.
struct RowRuns {
  std::vector<int32_t> first, count;
  void add(int32_t row, int32_t n);  // extends the last run when contiguous
  int64_t rows() const;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;

  // In place, deterministic (see above).
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  virtual void all_reduce_sum(double* data, int64_t n) = 0;
  virtual void all_reduce_sum(int64_t* data, int64_t n) = 0;
  // In place, exact. The "does any rank still have a batch" rule: min over ranks.
  virtual void all_reduce_min(int64_t* data, int64_t n) = 0;

  // send [size·n]: block j goes to rank j; recv [size·n]: block j came from rank j.
  virtual void all_to_all(const int64_t* send, int64_t* recv, int64_t n) = 0;
  // Row exchange: send_rows[j] rows of `row_width` floats go to rank j, taken consecutively from
  // `send` (rank 0's rows first); recv_rows[j] rows arrive from rank j, stored consecutively in
  // `recv` in rank order. send_rows/recv_rows have size() entries and must agree pairwise
  // across ranks (usually recv_rows is the all_to_all of send_rows).
  virtual void all_to_all_v(const float* send, const int64_t* send_rows, float* recv,
                            const int64_t* recv_rows, int64_t row_width) = 0;
  // The same exchange with the rows gathered from and scattered to where they live: to[j]
  // names the rows of `send` for rank j, from[j] the rows of `recv` that rank j's rows fill
  // (to[j].rows() on rank i equals from[i].rows() on rank j). One pass over the data instead of
  // pack, exchange, unpack (MPI: one MPI_Alltoallw with indexed row datatypes). `send` and
  // `recv` must not overlap.
  virtual void all_to_all_rows(const float* send, const std::vector<RowRuns>& to, float* recv,
                               const std::vector<RowRuns>& from, int64_t row_width) = 0;

  // Ranks with the same color form a new communicator, ordered by (key, old rank). Collective
  // over this communicator. E.g. the EP group of world rank w with EP size e: color w / e.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Ends every rank of the job (MPI_Abort on the world) with `code`; never returns.
  [[noreturn]] virtual void abort(int code) = 0;

  virtual std::string name() const = 0;
};

// A world of one rank: collectives are copies.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void barrier() override {}
  void all_reduce_sum(float*, int64_t) override {}
  void all_reduce_sum(double*, int64_t) override {}
  void all_reduce_sum(int64_t*, int64_t) override {}
  void all_reduce_min(int64_t*, int64_t) override {}
  void all_to_all(const int64_t* send, int64_t* recv, int64_t n) override;
  void all_to_all_v(const float* send, const int64_t* send_rows, float* recv,
                    const int64_t* recv_rows, int64_t row_width) override;
  void all_to_all_rows(const float* send, const std::vector<RowRuns>& to, float* recv,
                       const std::vector<RowRuns>& from, int64_t row_width) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  [[noreturn]] void abort(int code) override;
  std::string name() const override { return "local"; }
};

// MPI process lifetime, one per process. Construct it first thing in main() (before any thread
// is started); it calls MPI_Init_thread (MPI_THREAD_FUNNELED: only the main thread calls MPI,
// OpenMP workers never do). Its destructor calls MPI_Finalize on a normal exit; while an
// exception is unwinding through it, it calls MPI_Abort instead, because MPI_Finalize would
// wait for ranks that are blocked in a collective this rank will never join.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  // True once MPI_Init has run in this process and MPI_Finalize has not.
  static bool active();
  // True when this process was started by mpirun/mpiexec (the launcher's environment is set).
  static bool launched_by_mpirun();
};

class MpiCommunicator final : public Communicator {
 public:
  // MPI_COMM_WORLD. Requires an active MpiRuntime.
  static std::unique_ptr<MpiCommunicator> world();
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override;
  void all_reduce_sum(float* data, int64_t n) override;
  void all_reduce_sum(double* data, int64_t n) override;
  void all_reduce_sum(int64_t* data, int64_t n) override;
  void all_reduce_min(int64_t* data, int64_t n) override;
  void all_to_all(const int64_t* send, int64_t* recv, int64_t n) override;
  void all_to_all_v(const float* send, const int64_t* send_rows, float* recv,
                    const int64_t* recv_rows, int64_t row_width) override;
  void all_to_all_rows(const float* send, const std::vector<RowRuns>& to, float* recv,
                       const std::vector<RowRuns>& from, int64_t row_width) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  [[noreturn]] void abort(int code) override;
  std::string name() const override;

  // Elements per chunk of all_reduce_sum (bounded scratch: 2·chunk elements).
  static constexpr int64_t kReduceChunk = int64_t{1} << 20;

 private:
  struct Impl;
  explicit MpiCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1;
};

// The world for this process: MpiCommunicator when launched by mpirun (MpiRuntime must be
// active), else LocalCommunicator, so one process without mpirun needs no MPI at all.
std::unique_ptr<Communicator> make_world_communicator();

// Runs body(); if it throws, prints "rank R: error: <what>" to stderr and ends every rank
// through MPI_Abort (non-zero exit everywhere within seconds, never a hang). Returns body's
// result otherwise. Use it around everything that runs collectives in an MPI main().
int run_or_abort(const std::function<int()>& body);

}  // namespace moe
