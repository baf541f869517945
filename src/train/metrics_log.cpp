#include "train/metrics_log.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "io/atomic_file.h"

namespace moe {

MetricsLog::MetricsLog(const std::filesystem::path& path, int64_t resume_step, bool resuming)
    : path_(path) {
  if (resuming && std::filesystem::exists(path)) {
    std::ifstream in(path, std::ios::binary);
    std::string line, kept;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      // A torn last line (the process died mid-write) is dropped along with later steps.
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<int64_t>() <= resume_step)
        kept += line + "\n";
    }
    in.close();
    write_file_atomic(path, kept);
  }
  file_ = std::fopen(path.c_str(), resuming ? "ab" : "wb");
  MOE_CHECK(file_ != nullptr, "{}: cannot open the metrics file for writing", path.string());
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  MOE_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
            "{}: write failed", path_.string());
}

}  // namespace moe
