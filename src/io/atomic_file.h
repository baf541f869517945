#pragma once
// Crash-safe file replacement: new contents go to a temporary file next to the target, are
// fsynced, and only then renamed over the target (and the directory fsynced), so a reader or a
// crash sees either the complete old file or the complete new one, never a torn mix.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>

namespace moe {

// Replaces (or creates) `path` with `bytes`. The parent directory must exist.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// Makes creations, renames and removals of entries in `dir` durable.
void fsync_directory(const std::filesystem::path& dir);

// Streaming form for files too large to assemble in memory (checkpoint shards). Writes go to
// `<target>.tmp.<pid>.<n>`; commit() publishes them. Destroying the writer without commit() (an
// exception while writing, a failed conversion) deletes the temporary and leaves the target as
// it was.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path target);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  // fsync, rename over the target, fsync the directory. No writes are allowed afterwards.
  void commit();

  const std::filesystem::path& target() const { return target_; }
  const std::filesystem::path& temp_path() const { return temp_; }
  int64_t bytes_written() const { return bytes_written_; }

 private:
  void discard() noexcept;

  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool committed_ = false;
  int64_t bytes_written_ = 0;
};

}  // namespace moe
