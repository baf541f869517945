#pragma once
// The run's metrics as JSON Lines (one object per optimizer step), flushed line by line so a
// plot or `tail -f` sees every step as it happens.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace moe {

class MetricsLog {
 public:
  // A fresh run truncates the file. A run resumed at `resume_step` keeps the records up to that
  // step and drops later ones (written by the interrupted run after its last checkpoint), so
  // the file reads as one uninterrupted run.
  MetricsLog(const std::filesystem::path& path, int64_t resume_step, bool resuming);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void write(const nlohmann::json& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace moe
