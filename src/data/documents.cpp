#include "data/documents.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"

namespace moe {

namespace fs = std::filesystem;

DataFormat parse_data_format(const std::string& name, const std::string& key) {
  if (name == "auto") return DataFormat::Auto;
  if (name == "text") return DataFormat::Text;
  if (name == "jsonl") return DataFormat::Jsonl;
  fail("{}: expected \"auto\", \"text\" or \"jsonl\", got \"{}\"", key, name);
}

const char* data_format_name(DataFormat f) {
  switch (f) {
    case DataFormat::Auto: return "auto";
    case DataFormat::Text: return "text";
    case DataFormat::Jsonl: return "jsonl";
  }
  return "?";
}

namespace {

void read_jsonl(const fs::path& path, const std::string& field, std::vector<std::string>& out) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "{}: cannot open for reading", path.string());
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (std::all_of(line.begin(), line.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); }))
      continue;
    const nlohmann::json j = nlohmann::json::parse(
        line, json_depth_limit<nlohmann::json>(fmt::format("{}:{}", path.string(), line_no)),
        /*allow_exceptions=*/false);
    MOE_CHECK(!j.is_discarded(), "{}:{}: not valid JSON", path.string(), line_no);
    MOE_CHECK(j.is_object(), "{}:{}: expected a JSON object with a string field '{}', got {}",
              path.string(), line_no, field, j.type_name());
    auto it = j.find(field);
    MOE_CHECK(it != j.end() && it->is_string(), "{}:{}: expected a string field '{}'{}",
              path.string(), line_no, field,
              it == j.end() ? std::string(" (absent)") : ", got " + std::string(it->type_name()));
    std::string text = it->get<std::string>();
    if (!text.empty()) out.push_back(std::move(text));
  }
}

void read_file(const fs::path& path, const DocumentOptions& o, std::vector<std::string>& out) {
  const bool jsonl = o.format == DataFormat::Jsonl ||
                     (o.format == DataFormat::Auto && path.extension() == ".jsonl");
  if (jsonl) {
    read_jsonl(path, o.jsonl_field, out);
    return;
  }
  std::string text = read_whole_file(path);
  if (!text.empty()) out.push_back(std::move(text));
}

}  // namespace

std::string read_whole_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "{}: cannot open for reading", path.string());
  std::stringstream s;
  s << in.rdbuf();
  MOE_CHECK(!in.bad(), "{}: read error", path.string());
  return s.str();
}

std::vector<fs::path> list_data_files(const fs::path& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  MOE_CHECK(!ec && fs::exists(st), "{}: no such file or directory", path.string());
  if (!fs::is_directory(st)) return {path};
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(path); it != fs::recursive_directory_iterator();
       ++it) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file()) files.push_back(it->path());
  }
  MOE_CHECK(!files.empty(), "{}: the directory holds no data files", path.string());
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> read_documents(const fs::path& path, const DocumentOptions& options) {
  std::vector<std::string> docs;
  for (const fs::path& f : list_data_files(path)) read_file(f, options, docs);
  return docs;
}

}  // namespace moe
