#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"
#include "io/atomic_file.h"

namespace moe {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is read without byte swapping");

namespace {

using json = nlohmann::json;

// A header this large would describe millions of tensors; treating it as corruption avoids
// allocating gigabytes because of one flipped length byte.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Conversions between F32 and BF16 stream through a buffer of this size instead of
// materialising a second copy of a multi-gigabyte embedding.
constexpr int64_t kConvertChunkBytes = int64_t{4} << 20;

struct DTypeInfo {
  const char* name;
  int bits;
};
constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 8},    {"U8", 8},       {"I8", 8},       {"F8_E5M2", 8}, {"F8_E4M3", 8},
    {"F8_E8M0", 8}, {"I16", 16},     {"U16", 16},     {"F16", 16},    {"BF16", 16},
    {"I32", 32},    {"U32", 32},     {"F32", 32},     {"F64", 64},    {"I64", 64},
    {"U64", 64},    {"C64", 64},     {"F4", 4},       {"F6_E2M3", 6}, {"F6_E3M2", 6},
};

const char* json_type(const json& v) { return v.type_name(); }

// JSON integers may arrive as unsigned 64-bit values; anything beyond int64 is as corrupt as a
// negative offset.
bool json_int64(const json& v, int64_t& out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    out = v.get<int64_t>();
    return true;
  }
  return false;
}

std::string errno_text() { return std::strerror(errno); }

SafetensorsEntry parse_entry(const std::string& file, const std::string& name, const json& v) {
  MOE_CHECK(v.is_object(), "{}: tensor '{}': header entry must be an object, got {}", file, name,
            json_type(v));
  SafetensorsEntry e;
  e.name = name;

  auto dtype_it = v.find("dtype");
  MOE_CHECK(dtype_it != v.end(), "{}: tensor '{}': header entry has no 'dtype'", file, name);
  MOE_CHECK(dtype_it->is_string(), "{}: tensor '{}': 'dtype' must be a string, got {}", file, name,
            json_type(*dtype_it));
  e.dtype = dtype_it->get<std::string>();
  const int bits = safetensors_dtype_bits(e.dtype);
  MOE_CHECK(bits > 0, "{}: tensor '{}': unknown dtype '{}'", file, name, e.dtype);

  auto shape_it = v.find("shape");
  MOE_CHECK(shape_it != v.end(), "{}: tensor '{}': header entry has no 'shape'", file, name);
  MOE_CHECK(shape_it->is_array(), "{}: tensor '{}': 'shape' must be an array of integers, got {}",
            file, name, json_type(*shape_it));
  int64_t numel = 1;
  bool numel_overflows = false;
  for (const json& d : *shape_it) {
    int64_t dim = 0;
    MOE_CHECK(d.is_number_integer(), "{}: tensor '{}': 'shape' must be an array of integers, got "
              "element {}", file, name, d.dump());
    MOE_CHECK(json_int64(d, dim) && dim >= 0, "{}: tensor '{}': dimension {} in shape {} is negative or too large",
              file, name, d.dump(), shape_it->dump());
    e.shape.push_back(dim);
    numel_overflows = numel_overflows || __builtin_mul_overflow(numel, dim, &numel);
  }

  auto offsets_it = v.find("data_offsets");
  MOE_CHECK(offsets_it != v.end(), "{}: tensor '{}': header entry has no 'data_offsets'", file,
            name);
  const json& offsets = *offsets_it;
  MOE_CHECK(offsets.is_array() && offsets.size() == 2 && json_int64(offsets[0], e.begin) &&
                json_int64(offsets[1], e.end),
            "{}: tensor '{}': 'data_offsets' must be two non-negative integers [begin, end], got {}",
            file, name, offsets.dump());
  MOE_CHECK(e.begin >= 0 && e.end >= e.begin,
            "{}: tensor '{}': 'data_offsets' {} must satisfy 0 <= begin <= end", file, name,
            offsets.dump());

  int64_t expected_bits = 0;
  numel_overflows = numel_overflows || __builtin_mul_overflow(numel, int64_t{bits}, &expected_bits);
  MOE_CHECK(!numel_overflows && expected_bits % 8 == 0 && expected_bits / 8 == e.nbytes(),
            "{}: tensor '{}': data_offsets {} hold {} bytes, but {} {} needs {}", file, name,
            offsets.dump(), e.nbytes(), e.dtype, shape_str(e.shape),
            numel_overflows          ? std::string("more than 2^63 bits")
            : expected_bits % 8 == 0 ? fmt::format("{} bytes", expected_bits / 8)
                                     : fmt::format("{} bits", expected_bits));
  return e;
}

}  // namespace

int safetensors_dtype_bits(std::string_view dtype) {
  for (const auto& d : kDTypes)
    if (dtype == d.name) return d.bits;
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Reader

SafetensorsReader::SafetensorsReader(std::filesystem::path path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  MOE_CHECK(fd_ >= 0, "{}: cannot open safetensors file: {}", path_.string(), errno_text());
  try {
    struct stat st {};
    MOE_CHECK(::fstat(fd_, &st) == 0, "{}: cannot stat: {}", path_.string(), errno_text());
    MOE_CHECK(S_ISREG(st.st_mode), "{}: not a regular file", path_.string());
    file_size_ = st.st_size;
    parse_header();
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsReader::pread_exact(int64_t file_offset, int64_t size, void* dst,
                                    const SafetensorsEntry& e) const {
  char* p = static_cast<char*>(dst);
  while (size > 0) {
    const ssize_t n = ::pread(fd_, p, static_cast<size_t>(size), file_offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? errno_text() : "unexpected end of file (truncated?)";
      if (e.name.empty()) fail("{}: reading {} bytes at offset {} failed: {}", path_.string(), size,
                               file_offset, why);
      fail("{}: tensor '{}': reading {} bytes at offset {} failed: {}", path_.string(), e.name,
           size, file_offset, why);
    }
    p += n;
    size -= n;
    file_offset += n;
  }
}

void SafetensorsReader::parse_header() {
  const std::string file = path_.string();
  const SafetensorsEntry no_tensor;
  MOE_CHECK(file_size_ >= 8, "{}: not a safetensors file: {} bytes is shorter than the 8-byte "
            "header length", file, file_size_);
  unsigned char len_bytes[8];
  pread_exact(0, 8, len_bytes, no_tensor);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  MOE_CHECK(header_len <= kMaxHeaderBytes, "{}: header length {} exceeds the {} byte limit "
            "(corrupt or not a safetensors file)", file, header_len, kMaxHeaderBytes);
  MOE_CHECK(header_len <= static_cast<uint64_t>(file_size_ - 8),
            "{}: header length {} runs past the end of the file ({} bytes)", file, header_len,
            file_size_);
  check_load_bytes(file, fmt::format("parsing its {}-byte header", header_len),
                   static_cast<int64_t>(header_len) * kParsedBytesPerTextByte);
  data_start_ = 8 + static_cast<int64_t>(header_len);

  std::string text(header_len, '\0');
  pread_exact(8, static_cast<int64_t>(header_len), text.data(), no_tensor);

  // nlohmann keeps the last of duplicate keys silently; a duplicated tensor name would hide
  // one of the two tensors, so it is reported instead.
  std::set<std::string> seen;
  std::string duplicate;
  auto note_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    MOE_CHECK(depth <= kMaxJsonFileDepth, "{}: header nested more than {} levels deep", file,
              kMaxJsonFileDepth);
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(text, note_keys);
  } catch (const json::exception& ex) {
    fail("{}: header is not valid JSON: {}", file, ex.what());
  }
  MOE_CHECK(header.is_object(), "{}: header must be a JSON object, got {}", file,
            json_type(header));
  MOE_CHECK(duplicate.empty(), "{}: tensor '{}' appears twice in the header", file, duplicate);

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      MOE_CHECK(value.is_object(), "{}: '__metadata__' must be an object of strings, got {}", file,
                json_type(value));
      for (const auto& [mk, mv] : value.items()) {
        MOE_CHECK(mv.is_string(), "{}: '__metadata__' value of '{}' must be a string, got {}",
                  file, mk, json_type(mv));
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e = parse_entry(file, key, value);
    MOE_CHECK(data_start_ + e.end <= file_size_,
              "{}: tensor '{}': data_offsets [{}, {}] run past the end of the file (data buffer "
              "holds {} bytes)", file, key, e.begin, e.end, file_size_ - data_start_);
    entries_.push_back(std::move(e));
  }

  std::stable_sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Gaps are harmless (some writers align tensors); shared bytes mean a corrupt or hostile
  // header. Empty ranges occupy no bytes and cannot overlap anything.
  const SafetensorsEntry* previous = nullptr;
  for (const auto& e : entries_) {
    if (e.nbytes() == 0) continue;
    MOE_CHECK(previous == nullptr || e.begin >= previous->end,
              "{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", file,
              e.name, e.begin, e.end, previous->name, previous->begin, previous->end);
    previous = &e;
  }
  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
}

const SafetensorsEntry* SafetensorsReader::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const SafetensorsEntry& SafetensorsReader::entry(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  MOE_CHECK(e != nullptr, "{}: no tensor '{}' in this file", path_.string(), name);
  return *e;
}

void SafetensorsReader::read_bytes(const SafetensorsEntry& e, int64_t offset, int64_t size,
                                   void* dst) const {
  MOE_CHECK(offset >= 0 && size >= 0 && offset + size <= e.nbytes(),
            "{}: tensor '{}': byte range [{}, {}) lies outside its {} bytes", path_.string(),
            e.name, offset, offset + size, e.nbytes());
  if (size > 0) pread_exact(data_start_ + e.begin + offset, size, dst, e);
}

Tensor SafetensorsReader::read(std::string_view name, DType want, MemCategory category) const {
  const SafetensorsEntry& e = entry(name);
  // The shape's element count was checked against the file's bytes when the header was read;
  // a conversion may still widen it (BF16 -> F32).
  check_load_bytes(path_.string(), fmt::format("tensor '{}' ({} {} as {})", e.name, e.dtype,
                                               shape_str(e.shape), dtype_name(want)),
                   checked_size_product(shape_numel(e.shape), dtype_size(want), path_.string(),
                                        fmt::format("tensor '{}'", e.name)));
  Tensor t = Tensor::empty(e.shape, want, category);
  read_into(name, t);
  return t;
}

void SafetensorsReader::read_into(std::string_view name, const Tensor& dst) const {
  const SafetensorsEntry& e = entry(name);
  MOE_CHECK(dst.defined() && dst.shape() == e.shape,
            "{}: tensor '{}': the file holds shape {}, the destination has shape {}",
            path_.string(), e.name, shape_str(e.shape), shape_str(dst.shape()));
  const bool same = (dst.dtype() == DType::F32 && e.dtype == "F32") ||
                    (dst.dtype() == DType::BF16 && e.dtype == "BF16") ||
                    (dst.dtype() == DType::I32 && e.dtype == "I32") ||
                    (dst.dtype() == DType::U8 && safetensors_dtype_bits(e.dtype) == 8);
  if (same) {
    read_bytes(e, 0, e.nbytes(), dst.raw());
    return;
  }
  const bool f32_from_bf16 = dst.dtype() == DType::F32 && e.dtype == "BF16";
  const bool bf16_from_f32 = dst.dtype() == DType::BF16 && e.dtype == "F32";
  MOE_CHECK(f32_from_bf16 || bf16_from_f32, "{}: tensor '{}' has dtype {}, which cannot be loaded "
            "as {}", path_.string(), e.name, e.dtype, dtype_name(dst.dtype()));
  const int64_t src_size = f32_from_bf16 ? 2 : 4;
  const int64_t numel = dst.numel();
  const int64_t chunk = std::min<int64_t>(numel, kConvertChunkBytes / src_size);
  std::vector<unsigned char> buffer(static_cast<size_t>(chunk * src_size));
  for (int64_t start = 0; start < numel; start += chunk) {
    const int64_t n = std::min(chunk, numel - start);
    read_bytes(e, start * src_size, n * src_size, buffer.data());
    if (f32_from_bf16) {
      float* out = dst.f32() + start;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, buffer.data() + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
    } else {
      uint16_t* out = dst.bf16() + start;
      for (int64_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, buffer.data() + 4 * i, 4);
        out[i] = f32_to_bf16(f);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

namespace {

struct ResolvedItem {
  const SafetensorsWriteItem* item;
  std::string dtype;
  int64_t nbytes;
};

ResolvedItem resolve(const std::string& file, const SafetensorsWriteItem& item) {
  MOE_CHECK(item.tensor.defined(), "{}: tensor '{}' is undefined", file, item.name);
  const DType src = item.tensor.dtype();
  std::string dtype = item.dtype.empty() ? dtype_name(src) : item.dtype;
  const int bits = safetensors_dtype_bits(dtype);
  // F32 -> I64: an integer table kept in fp32 (Param::id_bound, V4's tid2eid) written as released.
  const bool ok = (src == DType::F32 && (dtype == "F32" || dtype == "BF16" || dtype == "I64")) ||
                  (src == DType::BF16 && (dtype == "BF16" || dtype == "F32")) ||
                  (src == DType::I32 && dtype == "I32") || (src == DType::U8 && bits == 8);
  MOE_CHECK(ok, "{}: tensor '{}': a {} tensor cannot be written as dtype '{}'", file, item.name,
            dtype_name(src), dtype);
  return {&item, dtype, item.tensor.numel() * bits / 8};
}

void write_converted(AtomicFileWriter& out, const Tensor& t, const std::string& dtype) {
  const int64_t numel = t.numel();
  const bool to_bf16 = t.dtype() == DType::F32 && dtype == "BF16";
  const bool to_f32 = t.dtype() == DType::BF16 && dtype == "F32";
  if (t.dtype() == DType::F32 && dtype == "I64") {
    const int64_t chunk = std::min<int64_t>(numel, kConvertChunkBytes / 8);
    std::vector<int64_t> buffer(static_cast<size_t>(chunk));
    for (int64_t start = 0; start < numel; start += chunk) {
      const int64_t n = std::min(chunk, numel - start);
      const float* in = t.f32() + start;
      for (int64_t i = 0; i < n; ++i) {
        MOE_CHECK(in[i] == std::nearbyint(in[i]) && std::fabs(in[i]) < 16777216.0f,
                  "writing I64: value {} at {} is not an exact integer", in[i], start + i);
        buffer[static_cast<size_t>(i)] = static_cast<int64_t>(in[i]);
      }
      out.write(buffer.data(), static_cast<size_t>(n * 8));
    }
    return;
  }
  if (!to_bf16 && !to_f32) {
    if (numel > 0) out.write(t.raw(), static_cast<size_t>(t.nbytes()));
    return;
  }
  const int64_t dst_size = to_bf16 ? 2 : 4;
  const int64_t chunk = std::min<int64_t>(numel, kConvertChunkBytes / dst_size);
  std::vector<unsigned char> buffer(static_cast<size_t>(chunk * dst_size));
  for (int64_t start = 0; start < numel; start += chunk) {
    const int64_t n = std::min(chunk, numel - start);
    if (to_bf16) {
      const float* in = t.f32() + start;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(in[i]);
        std::memcpy(buffer.data() + 2 * i, &h, 2);
      }
    } else {
      const uint16_t* in = t.bf16() + start;
      for (int64_t i = 0; i < n; ++i) {
        const float f = bf16_to_f32(in[i]);
        std::memcpy(buffer.data() + 4 * i, &f, 4);
      }
    }
    out.write(buffer.data(), static_cast<size_t>(n * dst_size));
  }
}

}  // namespace

namespace {

// The 8-byte length plus the JSON header (tensors in the given order, which is also their data
// order), padded with spaces so the data starts 8-byte aligned, as the reference writer does:
// memory-mapped readers can then view F32/I64 tensors in place.
std::string encode_header(const std::string& file, const std::vector<SafetensorsLayoutItem>& items,
                          const SafetensorsMetadata& metadata) {
  std::set<std::string_view> names;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& item : items) {
    MOE_CHECK(item.name != "__metadata__", "{}: '__metadata__' is reserved and cannot name a "
              "tensor", file);
    MOE_CHECK(names.insert(item.name).second, "{}: tensor '{}' is given twice", file, item.name);
    const int bits = safetensors_dtype_bits(item.dtype);
    MOE_CHECK(bits > 0, "{}: tensor '{}': unknown dtype '{}'", file, item.name, item.dtype);
    const int64_t nbytes = shape_numel(item.shape) * bits / 8;
    header[item.name] = {{"dtype", item.dtype},
                         {"shape", item.shape},
                         {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception& ex) {
    fail("{}: cannot encode the header (tensor names and metadata must be UTF-8): {}", file,
         ex.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(len >> (8 * i));
  return out + text;
}

}  // namespace

void write_safetensors_with_dtypes(const std::filesystem::path& path,
                                   const std::vector<SafetensorsWriteItem>& items,
                                   const SafetensorsMetadata& metadata) {
  const std::string file = path.string();
  std::vector<ResolvedItem> resolved;
  std::vector<SafetensorsLayoutItem> layout;
  resolved.reserve(items.size());
  for (const auto& item : items) {
    resolved.push_back(resolve(file, item));
    layout.push_back({item.name, resolved.back().dtype, item.tensor.shape()});
  }
  const std::string header = encode_header(file, layout, metadata);
  AtomicFileWriter out(path);
  out.write(header);
  for (const auto& r : resolved) write_converted(out, r.item->tensor, r.dtype);
  out.commit();
}

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::filesystem::path& path,
                                                 std::vector<SafetensorsLayoutItem> items,
                                                 const SafetensorsMetadata& metadata)
    : out_(std::make_unique<AtomicFileWriter>(path)) {
  const std::string header = encode_header(path.string(), items, metadata);
  for (const auto& item : items)
    data_bytes_ += shape_numel(item.shape) * safetensors_dtype_bits(item.dtype) / 8;
  out_->write(header);
  header_bytes_ = static_cast<int64_t>(header.size());
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;

void SafetensorsStreamWriter::append(const void* data, int64_t size) {
  MOE_CHECK(out_->bytes_written() - header_bytes_ + size <= data_bytes_,
            "{}: more data than the header announces ({} bytes)", out_->target().string(),
            data_bytes_);
  if (size > 0) out_->write(data, static_cast<size_t>(size));
}

void SafetensorsStreamWriter::commit() {
  MOE_CHECK(out_->bytes_written() - header_bytes_ == data_bytes_,
            "{}: {} data bytes written, the header announces {}", out_->target().string(),
            out_->bytes_written() - header_bytes_, data_bytes_);
  out_->commit();
}

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const SafetensorsMetadata& metadata) {
  std::vector<SafetensorsWriteItem> items;
  items.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) items.push_back({name, tensor, ""});
  write_safetensors_with_dtypes(path, items, metadata);
}

// ---------------------------------------------------------------------------------------------
// Model directories

SafetensorsSet::SafetensorsSet(std::filesystem::path dir) : dir_(std::move(dir)) {
  namespace fs = std::filesystem;
  const fs::path single = dir_ / kSafetensorsSingleFile;
  const fs::path index = dir_ / kSafetensorsIndexFile;
  std::error_code ec;
  if (fs::is_regular_file(single, ec)) {
    single_ = std::make_unique<SafetensorsReader>(single);
    return;
  }
  if (!fs::is_regular_file(index, ec)) {
    MOE_CHECK(fs::is_directory(dir_, ec), "{}: model directory does not exist", dir_.string());
    fail("{}: no model weights: neither {} nor {} exists", dir_.string(), kSafetensorsSingleFile,
         kSafetensorsIndexFile);
  }
  sharded_ = true;
  const std::string index_name = index.string();
  const std::string text = read_text_file_capped(index, "the weights index");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, json_depth_limit<nlohmann::json>(index_name));
  } catch (const nlohmann::json::exception& ex) {
    fail("{}: not valid JSON: {}", index_name, ex.what());
  }
  MOE_CHECK(j.is_object(), "{}: must be a JSON object, got {}", index_name, j.type_name());
  auto wm = j.find("weight_map");
  MOE_CHECK(wm != j.end() && wm->is_object(), "{}: field 'weight_map' must be an object mapping "
            "tensor names to shard files", index_name);
  std::set<std::string> checked;
  for (const auto& [tensor, shard_value] : wm->items()) {
    MOE_CHECK(shard_value.is_string(), "{}: weight_map entry '{}' must be a shard file name, got {}",
              index_name, tensor, shard_value.type_name());
    const std::string shard_file = shard_value.get<std::string>();
    if (checked.insert(shard_file).second) {
      // Shards are files inside the model directory; a path escaping it is not a checkpoint.
      const fs::path rel(shard_file);
      bool escapes = shard_file.empty() || rel.is_absolute();
      for (const auto& part : rel) escapes = escapes || part == "..";
      MOE_CHECK(!escapes, "{}: weight_map entry '{}' names shard '{}', which is not a file inside "
                "{}", index_name, tensor, shard_file, dir_.string());
      MOE_CHECK(fs::is_regular_file(dir_ / rel, ec), "{}: weight_map maps tensor '{}' to shard "
                "'{}', which does not exist in {}", index_name, tensor, shard_file, dir_.string());
    }
    weight_map_.emplace(tensor, shard_file);
  }
}

SafetensorsSet::~SafetensorsSet() = default;

int64_t SafetensorsSet::open_files() const {
  if (single_) return 1;
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (const auto& [file, reader] : shards_) n += reader != nullptr;
  return n;
}

SafetensorsIndex read_safetensors_index(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SafetensorsIndex out;
  if (fs::is_regular_file(dir / kSafetensorsSingleFile, ec)) {
    out.files.push_back(kSafetensorsSingleFile);
    return out;
  }
  const fs::path index = dir / kSafetensorsIndexFile;
  if (!fs::is_regular_file(index, ec)) {
    MOE_CHECK(fs::is_directory(dir, ec), "{}: model directory does not exist", dir.string());
    fail("{}: no model weights: neither {} nor {} exists", dir.string(), kSafetensorsSingleFile,
         kSafetensorsIndexFile);
  }
  out.sharded = true;
  const std::string text = read_text_file_capped(index, "the weights index");
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text, json_depth_limit<nlohmann::ordered_json>(index.string()));
  } catch (const nlohmann::ordered_json::exception& ex) {
    fail("{}: not valid JSON: {}", index.string(), ex.what());
  }
  MOE_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
            "{}: field 'weight_map' must be an object mapping tensor names to shard files",
            index.string());
  std::set<std::string> seen;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    MOE_CHECK(file.is_string(), "{}: weight_map entry '{}' must be a shard file name, got {}",
              index.string(), tensor, file.type_name());
    const std::string f = file.get<std::string>();
    const fs::path rel(f);
    bool escapes = f.empty() || rel.is_absolute();
    for (const auto& part : rel) escapes = escapes || part == "..";
    MOE_CHECK(!escapes, "{}: weight_map entry '{}' names shard '{}', which is not a file inside "
              "{}", index.string(), tensor, f, dir.string());
    if (seen.insert(f).second) out.files.push_back(f);
    out.weight_map.emplace_back(tensor, f);
  }
  return out;
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> out;
  if (single_) {
    for (const auto& e : single_->entries()) out.push_back(e.name);
    std::sort(out.begin(), out.end());
  } else {
    for (const auto& [name, file] : weight_map_) out.push_back(name);
  }
  return out;
}

bool SafetensorsSet::contains(std::string_view name) const {
  return single_ ? single_->contains(name) : weight_map_.find(name) != weight_map_.end();
}

const SafetensorsReader& SafetensorsSet::shard(const std::string& file) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& reader = shards_[file];
  if (!reader) reader = std::make_unique<SafetensorsReader>(dir_ / file);
  return *reader;
}

const SafetensorsReader* SafetensorsSet::find(std::string_view name) const {
  if (single_) return single_->contains(name) ? single_.get() : nullptr;
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) return nullptr;
  const SafetensorsReader& reader = shard(it->second);
  MOE_CHECK(reader.contains(name), "{}: maps tensor '{}' to {}, but that file has no such tensor",
            (dir_ / kSafetensorsIndexFile).string(), name, reader.path().string());
  return &reader;
}

const SafetensorsReader& SafetensorsSet::reader_for(std::string_view name) const {
  const SafetensorsReader* reader = find(name);
  MOE_CHECK(reader != nullptr, "{}: no tensor '{}' in the model weights", dir_.string(), name);
  return *reader;
}

}  // namespace moe
