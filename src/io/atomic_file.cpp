#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/error.h"

namespace moe {

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

void fsync_directory(const std::filesystem::path& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MOE_CHECK(dfd >= 0, "{}: cannot open directory to make its entries durable: {}", dir.string(),
            errno_text());
  const int rc = ::fsync(dfd);
  const int saved = errno;
  ::close(dfd);
  // Some filesystems cannot fsync directories (EINVAL); their entries are then as durable as
  // they allow, so only real I/O failures are reported.
  if (rc != 0 && saved != EINVAL)
    fail("{}: fsync of directory failed: {}", dir.string(), std::strerror(saved));
}

AtomicFileWriter::AtomicFileWriter(std::filesystem::path target) : target_(std::move(target)) {
  MOE_CHECK(!target_.empty() && target_.has_filename(), "cannot write a file at path '{}'",
            target_.string());
  // The temporary lives in the target's directory so that rename() stays within one filesystem
  // (and therefore atomic); pid and counter keep concurrent writers (processes, threads) off
  // each other's temporaries.
  static std::atomic<uint64_t> counter{0};
  temp_ = target_;
  temp_ += fmt::format(".tmp.{}.{}", ::getpid(), counter.fetch_add(1));
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOE_CHECK(fd_ >= 0, "{}: cannot create temporary file {}: {}", target_.string(), temp_.string(),
            errno_text());
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) discard();
}

void AtomicFileWriter::discard() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  ::unlink(temp_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t size) {
  MOE_CHECK(fd_ >= 0, "{}: write after commit", target_.string());
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux transfers at most ~2 GiB per call; larger tensors take several rounds.
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    MOE_CHECK(n > 0, "{}: writing {} failed: {}", target_.string(), temp_.string(),
              n < 0 ? errno_text() : std::string("no progress"));
    p += n;
    size -= static_cast<size_t>(n);
    bytes_written_ += n;
  }
}

void AtomicFileWriter::commit() {
  MOE_CHECK(fd_ >= 0, "{}: commit called twice", target_.string());
  // Without the fsync, a crash right after the rename could publish a file whose blocks were
  // never written (an empty or zero-filled "new" version replacing good data).
  MOE_CHECK(::fsync(fd_) == 0, "{}: fsync of {} failed: {}", target_.string(), temp_.string(),
            errno_text());
  const int rc = ::close(fd_);
  fd_ = -1;
  MOE_CHECK(rc == 0, "{}: closing {} failed: {}", target_.string(), temp_.string(), errno_text());
  MOE_CHECK(::rename(temp_.c_str(), target_.c_str()) == 0, "{}: renaming {} over it failed: {}",
            target_.string(), temp_.string(), errno_text());
  committed_ = true;
  fsync_directory(target_.has_parent_path() ? target_.parent_path() : ".");
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFileWriter writer(path);
  writer.write(bytes);
  writer.commit();
}

}  // namespace moe
