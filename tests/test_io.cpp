#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/limits.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "io/token_file.h"
#include "model/config.h"
#include "model/param.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// A fresh, empty directory per test, so tests neither see each other's files nor depend on
// what an earlier run left behind.
fs::path scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(MOE_BINARY_DIR) / "test_io_tmp" /
                       (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_raw(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file crafted byte by byte: length prefix, header text as given, data bytes.
fs::path craft(const fs::path& dir, const std::string& header, size_t data_bytes = 0,
               const std::string& name = "broken.safetensors") {
  const fs::path p = dir / name;
  write_raw(p, le64(header.size()) + header + std::string(data_bytes, '\x11'));
  return p;
}

// Runs `fn`, expecting a moe::Error whose message contains every one of `needles`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "expected moe::Error";
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0);
}

Tensor f32_tensor(const Shape& shape, std::vector<float> values) {
  Tensor t = Tensor::empty(shape, DType::F32, MemCategory::Scratch);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  if (!values.empty()) std::memcpy(t.raw(), values.data(), values.size() * sizeof(float));
  return t;
}

Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape, DType::F32, MemCategory::Scratch);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = value;
  return t;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// atomic_file

TEST(AtomicFile, WritesAndReplacesLeavingNoTemporary) {
  const fs::path dir = scratch_dir();
  const fs::path p = dir / "a.txt";
  write_file_atomic(p, "first");
  EXPECT_EQ(read_text(p), "first");
  write_file_atomic(p, "second, longer");
  EXPECT_EQ(read_text(p), "second, longer");
  write_file_atomic(p, "");
  EXPECT_EQ(read_text(p), "");
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1);
}

TEST(AtomicFile, UncommittedWriterLeavesTheOldFile) {
  const fs::path dir = scratch_dir();
  const fs::path p = dir / "keep.txt";
  write_file_atomic(p, "precious");
  fs::path temp;
  {
    AtomicFileWriter w(p);
    temp = w.temp_path();
    w.write("half-written replacement");
    EXPECT_TRUE(fs::exists(temp));
    EXPECT_EQ(read_text(p), "precious");
  }
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_EQ(read_text(p), "precious");

  AtomicFileWriter w(p);
  w.write("new ");
  w.write(std::string_view("contents"));
  EXPECT_EQ(w.bytes_written(), 12);
  w.commit();
  EXPECT_EQ(read_text(p), "new contents");
  EXPECT_FALSE(fs::exists(w.temp_path()));
}

TEST(AtomicFile, MissingDirectoryNamesThePath) {
  const fs::path p = scratch_dir() / "no" / "such" / "dir" / "f.txt";
  expect_error([&] { write_file_atomic(p, "x"); }, {p.string()});
}

// ---------------------------------------------------------------------------------------------
// safetensors: writing and reading

TEST(Safetensors, RoundTripIsBitwiseForEveryDtype) {
  const fs::path p = scratch_dir() / "all.safetensors";
  Rng rng(7);
  Tensor f = random_tensor({3, 5}, rng);
  f.f32()[0] = -0.0f;
  f.f32()[1] = std::numeric_limits<float>::infinity();
  f.f32()[2] = std::numeric_limits<float>::denorm_min();
  const uint32_t nan_payload = 0x7fc12345u;
  std::memcpy(f.f32() + 3, &nan_payload, 4);
  Tensor b = Tensor::empty({4, 2}, DType::BF16, MemCategory::Scratch);
  for (int64_t i = 0; i < b.numel(); ++i) b.bf16()[i] = static_cast<uint16_t>(0x3f80 + 977 * i);
  Tensor i32 = Tensor::empty({5}, DType::I32, MemCategory::Scratch);
  for (int64_t i = 0; i < 5; ++i) i32.i32()[i] = static_cast<int32_t>(i * 1000003 - 2000000000);
  Tensor u8 = Tensor::empty({2, 3, 1}, DType::U8, MemCategory::Scratch);
  for (int64_t i = 0; i < 6; ++i) u8.u8()[i] = static_cast<uint8_t>(250 + i);
  Tensor scalar = f32_tensor({}, {3.25f});
  Tensor empty_f32 = Tensor::empty({0, 16}, DType::F32, MemCategory::Scratch);
  Tensor empty_bf16 = Tensor::empty({7, 0}, DType::BF16, MemCategory::Scratch);
  Tensor empty_u8 = Tensor::empty({0}, DType::U8, MemCategory::Scratch);

  // Deliberately not alphabetical: the file must keep the given order.
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"z.f32", f},           {"empty.f32", empty_f32}, {"b.bf16", b},
      {"empty.bf16", empty_bf16}, {"i.i32", i32},     {"u.u8", u8},
      {"empty.u8", empty_u8}, {"a.scalar", scalar}};
  write_safetensors(p, tensors, {{"format", "pt"}, {"note", "ünïcode"}});

  const std::string bytes = read_text(p);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ((8 + header_len) % 8, 0u);
  EXPECT_EQ(json::parse(bytes.substr(8, header_len)).size(), tensors.size() + 1);

  SafetensorsReader r(p);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("note"), "ünïcode");
  ASSERT_EQ(r.entries().size(), tensors.size());
  int64_t expected_offset = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto& [name, t] = tensors[k];
    const SafetensorsEntry& e = r.entries()[k];
    EXPECT_EQ(e.name, name);
    const SafetensorsEntry& by_name = r.entry(name);
    EXPECT_EQ(by_name.shape, t.shape()) << name;
    EXPECT_EQ(by_name.dtype, dtype_name(t.dtype())) << name;
    EXPECT_EQ(by_name.begin, expected_offset) << name;
    expected_offset += t.nbytes();
    EXPECT_TRUE(same_bytes(r.read(name, t.dtype()), t)) << name;
  }
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), 8 + static_cast<int64_t>(header_len) + expected_offset);
}

TEST(Safetensors, ConvertsBetweenF32AndBF16OnReadAndWrite) {
  const fs::path dir = scratch_dir();
  Rng rng(3);
  // More than one conversion chunk (4 MiB) so the chunk boundaries are exercised.
  Tensor f = random_tensor({1100, 1000}, rng);
  Tensor b = f.to(DType::BF16, MemCategory::Scratch);
  write_safetensors(dir / "f.safetensors", {{"w", f}});
  Tensor as_bf16 = SafetensorsReader(dir / "f.safetensors").read("w", DType::BF16);
  EXPECT_TRUE(same_bytes(as_bf16, b));

  write_safetensors(dir / "b.safetensors", {{"w", b}});
  SafetensorsReader rb(dir / "b.safetensors");
  EXPECT_EQ(rb.entry("w").dtype, "BF16");
  EXPECT_TRUE(same_bytes(rb.read("w", DType::F32), b.to(DType::F32, MemCategory::Scratch)));

  // F32 written as BF16 on the fly equals converting first.
  write_safetensors_with_dtypes(dir / "fb.safetensors", {{"w", f, "BF16"}});
  EXPECT_TRUE(same_bytes(SafetensorsReader(dir / "fb.safetensors").read("w", DType::BF16), b));
}

TEST(Safetensors, OneByteDtypesAreWrittenAndReadVerbatim) {
  const fs::path p = scratch_dir() / "mx.safetensors";
  Tensor blocks = Tensor::empty({4, 8}, DType::U8, MemCategory::Scratch);
  Tensor scales = Tensor::empty({4, 1}, DType::U8, MemCategory::Scratch);
  for (int64_t i = 0; i < 32; ++i) blocks.u8()[i] = static_cast<uint8_t>(i * 37);
  for (int64_t i = 0; i < 4; ++i) scales.u8()[i] = static_cast<uint8_t>(120 + i);
  write_safetensors_with_dtypes(p, {{"e.weight", blocks, "I8"}, {"e.scale", scales, "F8_E8M0"},
                                    {"raw", scales, ""}});
  SafetensorsReader r(p);
  EXPECT_EQ(r.entry("e.weight").dtype, "I8");
  EXPECT_EQ(r.entry("e.scale").dtype, "F8_E8M0");
  EXPECT_EQ(r.entry("raw").dtype, "U8");
  EXPECT_TRUE(same_bytes(r.read("e.weight", DType::U8), blocks));
  EXPECT_TRUE(same_bytes(r.read("e.scale", DType::U8), scales));
  expect_error([&] { r.read("e.scale", DType::F32); }, {p.string(), "e.scale", "F8_E8M0"});

  // Partial reads: one row of the packed weight.
  std::vector<uint8_t> row(8);
  r.read_bytes(r.entry("e.weight"), 16, 8, row.data());
  EXPECT_EQ(std::memcmp(row.data(), blocks.u8() + 16, 8), 0);
  expect_error([&] { r.read_bytes(r.entry("e.weight"), 30, 8, row.data()); }, {"e.weight"});
}

TEST(Safetensors, WriterRejectsImpossibleRequests) {
  const fs::path p = scratch_dir() / "w.safetensors";
  Tensor f = filled({2}, 1.0f);
  expect_error([&] { write_safetensors_with_dtypes(p, {{"x", f, "I8"}}); }, {p.string(), "x", "I8"});
  expect_error([&] { write_safetensors(p, {{"x", f}, {"x", f}}); }, {p.string(), "x", "twice"});
  expect_error([&] { write_safetensors(p, {{"__metadata__", f}}); }, {p.string(), "__metadata__"});
  EXPECT_FALSE(fs::exists(p));
}

// ---------------------------------------------------------------------------------------------
// safetensors: malformed files

TEST(SafetensorsMalformed, EveryDefectIsNamed) {
  const fs::path dir = scratch_dir();
  const std::string file = (dir / "broken.safetensors").string();
  auto opens = [&](const fs::path& p) { return [p] { SafetensorsReader r(p); }; };

  write_raw(dir / "broken.safetensors", "abc");
  expect_error(opens(dir / "broken.safetensors"), {file, "8-byte"});

  write_raw(dir / "broken.safetensors", le64(1000) + "{}");
  expect_error(opens(dir / "broken.safetensors"), {file, "header length 1000", "end of the file"});

  write_raw(dir / "broken.safetensors", le64(uint64_t{1} << 40) + "{}");
  expect_error(opens(dir / "broken.safetensors"), {file, "limit"});

  expect_error(opens(craft(dir, "{\"a\": {")), {file, "not valid JSON"});
  expect_error(opens(craft(dir, "[1, 2]")), {file, "object"});
  expect_error(opens(craft(dir, R"({"t": 5})")), {file, "'t'", "object"});

  const std::string ok_shape = R"("shape": [2])";
  const std::string ok_offsets = R"("data_offsets": [0, 8])";
  const std::string ok_dtype = R"("dtype": "F32")";
  auto entry = [](const std::string& body) { return "{\"w.0\": {" + body + "}}"; };
  expect_error(opens(craft(dir, entry(ok_shape + "," + ok_offsets), 8)), {file, "'w.0'", "dtype"});
  expect_error(opens(craft(dir, entry(ok_dtype + "," + ok_offsets), 8)), {file, "'w.0'", "shape"});
  expect_error(opens(craft(dir, entry(ok_dtype + "," + ok_shape), 8)), {file, "'w.0'", "data_offsets"});
  expect_error(opens(craft(dir, entry(R"("dtype": 4,)" + ok_shape + "," + ok_offsets), 8)),
               {file, "'w.0'", "dtype", "string"});
  expect_error(opens(craft(dir, entry(ok_dtype + R"(, "shape": "2",)" + ok_offsets), 8)),
               {file, "'w.0'", "shape"});
  expect_error(opens(craft(dir, entry(ok_dtype + R"(, "shape": [2.5],)" + ok_offsets), 8)),
               {file, "'w.0'", "shape"});
  expect_error(opens(craft(dir, entry(ok_dtype + "," + ok_shape + R"(, "data_offsets": [0])"), 8)),
               {file, "'w.0'", "data_offsets"});
  expect_error(opens(craft(dir, entry(ok_dtype + "," + ok_shape + R"(, "data_offsets": [0, "8"])"), 8)),
               {file, "'w.0'", "data_offsets"});
  expect_error(opens(craft(dir, entry(ok_dtype + "," + ok_shape + R"(, "data_offsets": [8, 0])"), 8)),
               {file, "'w.0'", "data_offsets"});
  expect_error(opens(craft(dir, entry(R"("dtype": "F13",)" + ok_shape + "," + ok_offsets), 8)),
               {file, "'w.0'", "unknown dtype 'F13'"});
  expect_error(opens(craft(dir, entry(ok_dtype + R"(, "shape": [-1, 2],)" + ok_offsets), 8)),
               {file, "'w.0'", "-1"});
  // Byte size != numel * dtype size, including a shape whose element count overflows int64.
  expect_error(opens(craft(dir, entry(ok_dtype + R"(, "shape": [3],)" + ok_offsets), 8)),
               {file, "'w.0'", "8 bytes", "F32 [3]"});
  expect_error(opens(craft(dir, entry(ok_dtype + R"(, "shape": [4294967296, 4294967296],)" + ok_offsets), 8)),
               {file, "'w.0'"});
  // Runs past the end of the file.
  expect_error(opens(craft(dir, entry(ok_dtype + "," + ok_shape + "," + ok_offsets), 7)),
               {file, "'w.0'", "end of the file"});
  // Overlapping ranges name both tensors.
  expect_error(opens(craft(dir, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}})", 10)),
               {file, "'a'", "'b'", "overlaps"});
  expect_error(opens(craft(dir, R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                  "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})", 2)),
               {file, "'a'", "twice"});
  expect_error(opens(craft(dir, R"({"__metadata__": {"format": 1}})")), {file, "__metadata__", "format"});
  expect_error(opens(dir / "absent.safetensors"), {(dir / "absent.safetensors").string()});
}

TEST(SafetensorsMalformed, GapsAndEmptyRangesAreTolerated) {
  const fs::path dir = scratch_dir();
  const fs::path p = dir / "gappy.safetensors";
  float a = 1.5f, b = -2.0f;
  std::string data(16, '\0');
  std::memcpy(&data[0], &a, 4);
  std::memcpy(&data[12], &b, 4);
  const std::string header = R"({"b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
                                 "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [2, 2]},
                                 "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}})";
  write_raw(p, le64(header.size()) + header + data);
  SafetensorsReader r(p);
  EXPECT_EQ(r.entries().front().name, "a");
  EXPECT_EQ(r.entries().back().name, "b");
  EXPECT_EQ(r.read("a", DType::F32).f32()[0], 1.5f);
  EXPECT_EQ(r.read("b", DType::F32).f32()[0], -2.0f);
  EXPECT_EQ(r.read("e", DType::F32).shape(), (Shape{0, 3}));
  expect_error([&] { r.read("c", DType::F32); }, {p.string(), "'c'"});
}

// ---------------------------------------------------------------------------------------------
// Model directories

TEST(SafetensorsSet, FindsTensorsAcrossShardsAndNamesBrokenLayouts) {
  const fs::path dir = scratch_dir();
  expect_error([&] { SafetensorsSet s(dir); }, {dir.string(), "model.safetensors"});
  expect_error([&] { SafetensorsSet s(dir / "nope"); }, {(dir / "nope").string(), "does not exist"});

  write_safetensors(dir / "part-a.safetensors", {{"x", filled({2}, 1.0f)}, {"y", filled({3}, 2.0f)}});
  write_safetensors(dir / "part-b.safetensors", {{"z", filled({1}, 3.0f)}});
  json index = {{"metadata", {{"total_size", 24}}},
                {"weight_map", {{"x", "part-a.safetensors"}, {"y", "part-a.safetensors"},
                                {"z", "part-b.safetensors"}}}};
  write_raw(dir / "model.safetensors.index.json", index.dump());
  {
    SafetensorsSet s(dir);
    EXPECT_TRUE(s.sharded());
    EXPECT_EQ(s.names(), (std::vector<std::string>{"x", "y", "z"}));
    EXPECT_EQ(s.read("z", DType::F32).f32()[0], 3.0f);
    EXPECT_EQ(s.read("y", DType::F32).f32()[2], 2.0f);
    EXPECT_EQ(s.find("missing"), nullptr);
    expect_error([&] { s.reader_for("missing"); }, {dir.string(), "missing"});
  }

  const std::string index_file = (dir / "model.safetensors.index.json").string();
  index["weight_map"]["w"] = "part-a.safetensors";  // the shard does not hold it
  write_raw(dir / "model.safetensors.index.json", index.dump());
  expect_error([&] { SafetensorsSet(dir).find("w"); }, {index_file, "'w'", "part-a.safetensors"});

  index["weight_map"]["w"] = "part-c.safetensors";
  write_raw(dir / "model.safetensors.index.json", index.dump());
  expect_error([&] { SafetensorsSet s(dir); }, {index_file, "part-c.safetensors", "does not exist"});

  index["weight_map"]["w"] = "../outside.safetensors";
  write_raw(dir / "model.safetensors.index.json", index.dump());
  expect_error([&] { SafetensorsSet s(dir); }, {index_file, "outside"});

  write_raw(dir / "model.safetensors.index.json", R"({"weight_map": [1]})");
  expect_error([&] { SafetensorsSet s(dir); }, {index_file, "weight_map"});

  // A single model.safetensors wins over an index, as in transformers.
  write_safetensors(dir / "model.safetensors", {{"only", filled({1}, 9.0f)}});
  SafetensorsSet single(dir);
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.names(), std::vector<std::string>{"only"});
}

// Found by tests/fuzz/fuzz_safetensors_index: a deeply nested index overflowed the stack when an
// error message printed the offending value.
TEST(SafetensorsSet, DeeplyNestedIndexIsAnError) {
  const fs::path dir = scratch_dir();
  const std::string deep(100000, '[');
  write_raw(dir / kSafetensorsIndexFile, R"({"weight_map": {"w": )" + deep + std::string(deep.size(), ']') + "}}");
  expect_error([&] { SafetensorsSet set(dir); }, {kSafetensorsIndexFile, "nested more than 64"});
  expect_error([&] { read_safetensors_index(dir); }, {kSafetensorsIndexFile, "nested more than 64"});
}

// ---------------------------------------------------------------------------------------------
// config.json

namespace {

const char* kDeepSeekV3Config = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
  "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
  "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
  "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
  "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
  "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
  "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
  "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
  "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
  "v_head_dim": 128, "vocab_size": 129280})";

const char* kDeepSeekV2LiteConfig = R"({
  "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001,
  "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
  "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
  "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
  "norm_topk_prob": false, "num_attention_heads": 16, "num_experts_per_tok": 6,
  "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": null,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                   "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": true,
  "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy",
  "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
  "v_head_dim": 128, "vocab_size": 102400})";

// A small valid MoE config; tests edit single fields of it.
json tiny_config_json() {
  return json::parse(R"({
    "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "first_k_dense_replace": 1, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "q_lora_rank": null, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2, "v_head_dim": 4})");
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
#define MOE_EXPECT_FIELD(f) EXPECT_EQ(a.f, b.f) << #f
  MOE_EXPECT_FIELD(model_type); MOE_EXPECT_FIELD(vocab_size); MOE_EXPECT_FIELD(hidden_size);
  MOE_EXPECT_FIELD(intermediate_size); MOE_EXPECT_FIELD(moe_intermediate_size);
  MOE_EXPECT_FIELD(num_hidden_layers); MOE_EXPECT_FIELD(num_attention_heads);
  MOE_EXPECT_FIELD(first_k_dense_replace); MOE_EXPECT_FIELD(moe_layer_freq);
  MOE_EXPECT_FIELD(n_routed_experts); MOE_EXPECT_FIELD(n_shared_experts);
  MOE_EXPECT_FIELD(num_experts_per_tok); MOE_EXPECT_FIELD(n_group); MOE_EXPECT_FIELD(topk_group);
  MOE_EXPECT_FIELD(topk_method); MOE_EXPECT_FIELD(scoring_func); MOE_EXPECT_FIELD(norm_topk_prob);
  MOE_EXPECT_FIELD(routed_scaling_factor); MOE_EXPECT_FIELD(aux_loss_alpha);
  MOE_EXPECT_FIELD(seq_aux); MOE_EXPECT_FIELD(q_lora_rank); MOE_EXPECT_FIELD(kv_lora_rank);
  MOE_EXPECT_FIELD(qk_nope_head_dim); MOE_EXPECT_FIELD(qk_rope_head_dim);
  MOE_EXPECT_FIELD(v_head_dim); MOE_EXPECT_FIELD(rms_norm_eps); MOE_EXPECT_FIELD(rope_theta);
  MOE_EXPECT_FIELD(max_position_embeddings); MOE_EXPECT_FIELD(rope_scaling.type);
  MOE_EXPECT_FIELD(rope_scaling.factor);
  MOE_EXPECT_FIELD(rope_scaling.original_max_position_embeddings);
  MOE_EXPECT_FIELD(rope_scaling.beta_fast); MOE_EXPECT_FIELD(rope_scaling.beta_slow);
  MOE_EXPECT_FIELD(rope_scaling.mscale); MOE_EXPECT_FIELD(rope_scaling.mscale_all_dim);
  MOE_EXPECT_FIELD(tie_word_embeddings); MOE_EXPECT_FIELD(torch_dtype);
  MOE_EXPECT_FIELD(bos_token_id); MOE_EXPECT_FIELD(eos_token_id);
#undef MOE_EXPECT_FIELD
}

void expect_lossless_round_trip(const ModelConfig& c) {
  const json j1 = model_config_to_json(c);
  const ModelConfig c1 = parse_hf_config(j1, "first");
  expect_same_config(c, c1);
  const json j2 = model_config_to_json(c1);
  EXPECT_EQ(j1, j2);
  expect_same_config(c1, parse_hf_config(j2, "second"));
}

}  // namespace

TEST(HfConfig, ReadsDeepSeekV3) {
  const ModelConfig c = parse_hf_config(json::parse(kDeepSeekV3Config), "v3/config.json");
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.rope_scaling.is_yarn());
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 40.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_DOUBLE_EQ(c.aux_loss_alpha, 0.001);
  expect_lossless_round_trip(c);
}

TEST(HfConfig, ReadsDeepSeekV2Lite) {
  const ModelConfig c = parse_hf_config(json::parse(kDeepSeekV2LiteConfig), "v2/config.json");
  EXPECT_EQ(c.model_type, "deepseek_v2");
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.topk_method, "greedy");
  EXPECT_EQ(c.scoring_func, "softmax");
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale_all_dim, 0.707);
  EXPECT_EQ(c.bos_token_id, 100000);
  expect_lossless_round_trip(c);

  const json out = model_config_to_json(c);
  EXPECT_TRUE(out["q_lora_rank"].is_null());
  EXPECT_EQ(out["architectures"], json::array({"DeepseekV2ForCausalLM"}));
}

TEST(HfConfig, AppliesTransformersDefaultsPerModelType) {
  json j = tiny_config_json();
  j["n_group"] = nullptr;
  j["topk_group"] = nullptr;
  j["an_unknown_field"] = {{"nested", json::array({1, "two"})}};
  ModelConfig v3 = parse_hf_config(j, "v3");
  EXPECT_EQ(v3.topk_method, "noaux_tc");
  EXPECT_EQ(v3.scoring_func, "sigmoid");
  EXPECT_TRUE(v3.norm_topk_prob);
  EXPECT_EQ(v3.n_group, 1);
  EXPECT_EQ(v3.topk_group, 1);
  EXPECT_FALSE(v3.rope_scaling.is_yarn());
  EXPECT_EQ(v3.torch_dtype, "float32");
  expect_lossless_round_trip(v3);
  EXPECT_EQ(model_config_to_json(v3)["architectures"], json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_TRUE(model_config_to_json(v3)["rope_scaling"].is_null());

  j["model_type"] = "deepseek_v2";
  ModelConfig v2 = parse_hf_config(j, "v2");
  EXPECT_EQ(v2.topk_method, "greedy");
  EXPECT_EQ(v2.scoring_func, "softmax");
  EXPECT_FALSE(v2.norm_topk_prob);
  expect_lossless_round_trip(v2);

  j["n_routed_experts"] = nullptr;
  ModelConfig dense = parse_hf_config(j, "dense");
  EXPECT_EQ(dense.n_routed_experts, 0);
  EXPECT_FALSE(dense.is_moe_layer(1));
  EXPECT_TRUE(model_config_to_json(dense)["n_routed_experts"].is_null());
  expect_lossless_round_trip(dense);
}

TEST(HfConfig, RopeScalingFollowsTypeOrRopeType) {
  json j = tiny_config_json();
  j["max_position_embeddings"] = 8192;
  j["rope_scaling"] = nullptr;
  EXPECT_FALSE(parse_hf_config(j, "t").rope_scaling.is_yarn());
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4}};
  ModelConfig c = parse_hf_config(j, "t");
  EXPECT_TRUE(c.rope_scaling.is_yarn());
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 32.0);
  expect_lossless_round_trip(c);
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.5}, {"original_max_position_embeddings", 1024},
                       {"mscale_all_dim", 0.5}};
  c = parse_hf_config(j, "t");
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale_all_dim, 0.5);
  expect_lossless_round_trip(c);
  j["rope_scaling"] = {{"type", "default"}};
  EXPECT_FALSE(parse_hf_config(j, "t").rope_scaling.is_yarn());

  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2}};
  expect_error([&] { parse_hf_config(j, "cfg.json"); }, {"cfg.json", "rope_scaling.type", "yarn"});
  j["rope_scaling"] = {{"type", "yarn"}};
  expect_error([&] { parse_hf_config(j, "cfg.json"); }, {"cfg.json", "rope_scaling.factor"});
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", "40"}};
  expect_error([&] { parse_hf_config(j, "cfg.json"); }, {"cfg.json", "rope_scaling.factor", "number"});
  j["rope_scaling"] = "yarn";
  expect_error([&] { parse_hf_config(j, "cfg.json"); }, {"cfg.json", "rope_scaling", "object"});
}

TEST(HfConfig, RejectsBadValuesNamingTheField) {
  auto rejects = [](const char* field, const json& value, std::initializer_list<std::string> needles) {
    json j = tiny_config_json();
    if (value.is_discarded())
      j.erase(field);
    else
      j[field] = value;
    expect_error([&] { parse_hf_config(j, "bad/config.json"); }, needles);
  };
  const json erase = json(json::value_t::discarded);
  rejects("torch_dtype", "float16", {"bad/config.json", "torch_dtype", "bfloat16", "float32"});
  rejects("hidden_size", "16", {"bad/config.json", "hidden_size", "integer"});
  rejects("hidden_size", 16.5, {"bad/config.json", "hidden_size", "integer"});
  rejects("hidden_size", erase, {"bad/config.json", "hidden_size", "required"});
  rejects("q_lora_rank", erase, {"bad/config.json", "q_lora_rank", "required"});
  rejects("norm_topk_prob", 1, {"bad/config.json", "norm_topk_prob", "true or false"});
  rejects("rms_norm_eps", "1e-6", {"bad/config.json", "rms_norm_eps", "number"});
  rejects("topk_method", 3, {"bad/config.json", "topk_method", "string"});
  rejects("topk_method", "bogus", {"bad/config.json", "topk_method", "noaux_tc"});
  rejects("scoring_func", "relu", {"bad/config.json", "scoring_func", "sigmoid"});
  rejects("model_type", "llama", {"bad/config.json", "model_type", "deepseek_v3"});
  rejects("hidden_act", "gelu", {"bad/config.json", "hidden_act", "silu"});
  rejects("num_experts_per_tok", erase, {"bad/config.json", "num_experts_per_tok"});
  rejects("num_experts_per_tok", 17, {"bad/config.json", "num_experts_per_tok"});
  rejects("n_group", 3, {"bad/config.json", "n_group"});
  expect_error([] { parse_hf_config(json::array(), "bad/config.json"); }, {"bad/config.json", "object"});
}

TEST(HfConfig, FilesAreReadWrittenAndNamedInErrors) {
  const fs::path dir = scratch_dir();
  expect_error([&] { read_hf_config(dir); }, {(dir / "config.json").string()});
  write_raw(dir / "config.json", "{ not json");
  expect_error([&] { read_hf_config(dir / "config.json"); }, {(dir / "config.json").string(), "JSON"});
  write_raw(dir / "config.json", json(tiny_config_json()).dump());
  const ModelConfig c = read_hf_config(dir);
  write_hf_config(dir, c);
  expect_same_config(read_hf_config(dir / "config.json"), c);
  json j = tiny_config_json();
  j["vocab_size"] = -3;
  write_raw(dir / "config.json", j.dump());
  expect_error([&] { read_hf_config(dir); }, {(dir / "config.json").string(), "vocab_size"});
}

// Found by tests/fuzz/fuzz_model_config: sizes multiplied into parameter counts overflowed (and
// a layer count near 2^63 looped for ever), and a deeply nested field value overflowed the stack
// when the error message printed it.
TEST(HfConfig, HugeSizesAndDeepNestingAreErrorsNotOverflows) {
  auto rejects = [](std::initializer_list<std::pair<const char*, json>> fields,
                    std::initializer_list<std::string> needles) {
    json j = tiny_config_json();
    for (const auto& [field, value] : fields) j[field] = value;
    expect_error([&] { parse_hf_config(j, "big/config.json"); }, needles);
  };
  rejects({{"vocab_size", int64_t{1} << 40}}, {"big/config.json", "vocab_size", "16777216"});
  rejects({{"num_hidden_layers", std::numeric_limits<int64_t>::max()}},
          {"num_hidden_layers", "[0, 4096]"});
  rejects({{"n_shared_experts", int64_t{1} << 30}}, {"n_shared_experts", "[0, 16777216]"});
  rejects({{"hidden_size", 1 << 24}, {"intermediate_size", 1 << 24}, {"num_hidden_layers", 1 << 12},
           {"first_k_dense_replace", 1 << 12}},
          {"big/config.json", "parameters", "2^56"});
  rejects({{"rope_theta", std::numeric_limits<double>::infinity()}}, {"rope_theta", "finite"});

  const fs::path dir = scratch_dir();
  const std::string deep(100000, '[');
  write_raw(dir / "config.json", R"({"model_type": )" + deep + std::string(deep.size(), ']') + "}");
  expect_error([&] { read_hf_config(dir); }, {(dir / "config.json").string(), "nested more than 64"});
  json j = tiny_config_json();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, int64_t{1} << 40}}};
  expect_error([&] { parse_hf_weights_info(j, "big/config.json"); }, {"weight_block_size", "2^24"});
  // Read before validation (which MTP layers a tensor belongs to): bounded there too, so
  // num_hidden_layers + num_nextn_predict_layers cannot overflow (a fuzz finding).
  j = tiny_config_json();
  j["num_hidden_layers"] = int64_t{1} << 62;
  j["num_nextn_predict_layers"] = int64_t{1} << 62;
  expect_error([&] { parse_hf_weights_info(j, "big/config.json"); },
               {"big/config.json", "num_hidden_layers", "[0, 4096]"});
  j["num_hidden_layers"] = 4;
  expect_error([&] { parse_hf_weights_info(j, "big/config.json"); },
               {"big/config.json", "num_nextn_predict_layers", "[0, 4096]"});
}

TEST(TokenFile, ReadsEqualLinesAndRefusesRaggedOrOutOfRangeIdsAndPipes) {
  const fs::path dir = scratch_dir();
  write_raw(dir / "ids.txt", "1 2 3\n\n4 5\t6\r\n");
  const TokenBatch b = read_token_file(dir / "ids.txt");
  EXPECT_EQ(b.shape.batch, 2);
  EXPECT_EQ(b.shape.seq, 3);
  EXPECT_EQ(std::vector<int32_t>(b.tokens.i32(), b.tokens.i32() + 6), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  write_raw(dir / "ragged.txt", "1 2 3\n4 5\n");
  expect_error([&] { read_token_file(dir / "ragged.txt"); }, {"ragged.txt:2", "same length"});
  write_raw(dir / "big.txt", "1 2147483648\n");
  expect_error([&] { read_token_file(dir / "big.txt"); }, {"big.txt:1", "2147483648", "32-bit"});
  // A FIFO has no size to check before reading (and opening it would wait for a writer).
  ASSERT_EQ(::mkfifo((dir / "pipe").c_str(), 0600), 0);
  expect_error([&] { read_token_file(dir / "pipe"); }, {"pipe", "not a regular file"});
  expect_error([&] { read_token_file(dir / "missing.txt"); }, {"missing.txt", "cannot open"});
}

TEST(LoadCap, SizesAboveTheCapAndOverflowingProductsNameTheFileAndField) {
  expect_error([] { check_load_bytes("model/x.safetensors", "tensor 'w'", std::numeric_limits<int64_t>::max()); },
               {"model/x.safetensors", "tensor 'w'", "more than one load may allocate", kMaxLoadBytesEnv});
  expect_error([] { checked_size_product(int64_t{1} << 40, int64_t{1} << 40, "f.json", "ids"); },
               {"f.json", "ids", "64 bits"});
  EXPECT_EQ(checked_size_product(3, 5, "f", "x"), 15);
  EXPECT_GT(max_load_bytes(), 0);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

namespace {

struct ParamSet {
  std::vector<std::unique_ptr<Param>> owned;
  ParamList list;
  Param& add(const std::string& name, const Shape& shape) {
    owned.push_back(std::make_unique<Param>());
    owned.back()->init(name, shape, true);
    list.push_back(owned.back().get());
    return *owned.back();
  }
};

ModelConfig tiny_config() { return parse_hf_config(tiny_config_json(), "tiny"); }

}  // namespace

TEST(Checkpoint, LoadReportsShapeDtypeAndMissingTensors) {
  const fs::path dir = scratch_dir();
  Tensor i32 = Tensor::zeros({2}, DType::I32, MemCategory::Scratch);
  write_safetensors(dir / "model.safetensors",
                    {{"model.norm.weight", filled({2, 3}, 1.0f)},
                     {"model.layers.0.mlp.gate.weight", filled({4, 2}, 2.0f)},
                     {"model.layers.0.step", i32},
                     {"model.layers.61.mtp.weight", filled({5}, 3.0f)}});
  const std::string file = (dir / "model.safetensors").string();
  {
    ParamSet ps;
    ps.add("model.norm.weight", {3, 2});
    expect_error([&] { load_weights(dir, ps.list); }, {file, "model.norm.weight", "[2, 3]", "[3, 2]"});
  }
  {
    ParamSet ps;
    ps.add("model.layers.0.step", {2});
    expect_error([&] { load_weights(dir, ps.list); }, {file, "model.layers.0.step", "I32"});
  }
  {
    ParamSet ps;
    Param& norm = ps.add("model.norm.weight", {2, 3});
    ps.add("lm_head.weight", {4, 2});
    ps.add("model.embed_tokens.weight", {4, 2});
    expect_error([&] { load_weights(dir, ps.list); }, {dir.string(), "lm_head.weight", "1 more"});
    EXPECT_EQ(norm.value.f32()[0], 0.0f) << "nothing is loaded when any tensor is missing";
  }
  {
    // V2 checkpoints have no router correction bias; the extra MTP tensor is ignored.
    ParamSet ps;
    Param& gate = ps.add("model.layers.0.mlp.gate.weight", {4, 2});
    Param& bias = ps.add("model.layers.0.mlp.gate.e_score_correction_bias", {4});
    for (int i = 0; i < 4; ++i) bias.value.f32()[i] = 7.0f;
    load_weights(dir, ps.list);
    EXPECT_EQ(gate.value.f32()[7], 2.0f);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(bias.value.f32()[i], 0.0f);
  }
}

TEST(Checkpoint, ExpertsLoadByNumberNotByStringOrder) {
  const fs::path dir = scratch_dir();
  constexpr int kExperts = 16;
  auto key = [](int e) { return fmt::format("model.layers.1.mlp.experts.{}.down_proj.weight", e); };
  std::vector<std::string> names;
  for (int e = 0; e < kExperts; ++e) names.push_back(key(e));
  std::sort(names.begin(), names.end());  // 0, 1, 10, 11, ..., 15, 2, ..., 9: the trap
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : names) {
    const int e = std::stoi(n.substr(std::string("model.layers.1.mlp.experts.").size()));
    tensors.push_back({n, filled({3, 2}, 100.0f + static_cast<float>(e))});
  }
  // Split across two shards as well, so the lookup goes through the index.
  const size_t half = tensors.size() / 2;
  using Pairs = std::vector<std::pair<std::string, Tensor>>;
  write_safetensors(dir / "model-00001-of-00002.safetensors", Pairs(tensors.begin(), tensors.begin() + half));
  write_safetensors(dir / "model-00002-of-00002.safetensors", Pairs(tensors.begin() + half, tensors.end()));
  json weight_map;
  for (size_t i = 0; i < tensors.size(); ++i)
    weight_map[tensors[i].first] = i < half ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  write_raw(dir / "model.safetensors.index.json", json{{"weight_map", weight_map}}.dump());

  ParamSet ps;
  for (int e = 0; e < kExperts; ++e) ps.add(key(e), {3, 2});
  load_weights(dir, ps.list);
  for (int e = 0; e < kExperts; ++e)
    for (int64_t i = 0; i < 6; ++i) ASSERT_EQ(ps.list[static_cast<size_t>(e)]->value.f32()[i], 100.0f + static_cast<float>(e)) << "expert " << e;
}

TEST(Checkpoint, SaveThenLoadIsBitwise) {
  const fs::path dir = scratch_dir() / "model";
  const ModelConfig cfg = tiny_config();
  Rng rng(11);
  ParamSet src;
  src.add("model.embed_tokens.weight", {64, 16});
  src.add("model.layers.0.input_layernorm.weight", {16});
  src.add("model.layers.1.mlp.experts.10.gate_proj.weight", {8, 16});
  src.add("model.layers.1.mlp.experts.2.gate_proj.weight", {8, 16});
  src.add("model.layers.1.mlp.gate.e_score_correction_bias", {16});
  src.add("lm_head.weight", {64, 16});
  src.add("model.empty", {0, 16});
  for (Param* p : src.list) fill_random(p->value, rng);

  auto fresh_copy = [&] {
    auto dst = std::make_unique<ParamSet>();
    for (Param* p : src.list) dst->add(p->name, p->value.shape());
    return dst;
  };

  save_model(dir, cfg, src.list, DType::F32);
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_EQ(read_hf_config(dir).torch_dtype, "float32");
  {
    SafetensorsReader r(dir / "model.safetensors");
    EXPECT_EQ(r.metadata().at("format"), "pt");
    for (size_t i = 0; i < src.list.size(); ++i)  // file order = parameter order
      EXPECT_EQ(r.entries()[i].name, src.list[i]->name);
    auto dst = fresh_copy();
    load_weights(dir, dst->list);
    for (size_t i = 0; i < src.list.size(); ++i)
      EXPECT_TRUE(same_bytes(dst->list[i]->value, src.list[i]->value)) << src.list[i]->name;
  }

  // BF16: values already representable in bf16 survive exactly; sharded this time, over the
  // single-file save, which must disappear so it cannot shadow the new shards.
  for (Param* p : src.list) p->value.copy_from(p->value.to(DType::BF16, MemCategory::Scratch));
  save_model(dir, cfg, src.list, DType::BF16, /*max_shard_bytes=*/1000);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  const json index = json::parse(read_text(dir / "model.safetensors.index.json"));
  int64_t expected_total = 0;
  for (Param* p : src.list) expected_total += p->value.numel() * 2;
  EXPECT_EQ(index["metadata"]["total_size"], expected_total);
  // embed and lm_head (2048 B each) exceed the limit alone; the small ones share a shard, and
  // the empty tensor opens none.
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["model.layers.1.mlp.gate.e_score_correction_bias"],
            "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["lm_head.weight"], "model-00003-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["model.empty"], "model-00003-of-00003.safetensors");
  EXPECT_EQ(read_hf_config(dir).torch_dtype, "bfloat16");
  EXPECT_EQ(SafetensorsReader(dir / "model-00002-of-00003.safetensors").entries().front().dtype, "BF16");
  {
    auto dst = fresh_copy();
    load_weights(dir, dst->list);
    for (size_t i = 0; i < src.list.size(); ++i)
      EXPECT_TRUE(same_bytes(dst->list[i]->value, src.list[i]->value)) << src.list[i]->name;
  }

  // Back to one file: the index and its shards are removed.
  save_model(dir, cfg, src.list, DType::F32);
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 2);  // config.json + model.safetensors
  auto dst = fresh_copy();
  load_weights(dir, dst->list);
  EXPECT_TRUE(same_bytes(dst->list[2]->value, src.list[2]->value));
}

TEST(Checkpoint, SaveRejectsInvalidRequests) {
  const fs::path dir = scratch_dir();
  ParamSet ps;
  ps.add("w", {2});
  expect_error([&] { save_model(dir / "m", tiny_config(), ps.list, DType::I32); }, {"F32", "BF16"});
  ModelConfig bad = tiny_config();
  bad.hidden_size = 0;
  expect_error([&] { save_model(dir / "m", bad, ps.list); }, {"config.json", "hidden_size"});
  ps.add("w", {3});
  expect_error([&] { save_model(dir / "m", tiny_config(), ps.list); }, {"'w'", "twice"});
  EXPECT_FALSE(fs::exists(dir / "m"));
  ps.list.pop_back();
  save_model(dir / "nested" / "new/", tiny_config(), ps.list);  // creates both levels
  ParamSet back;
  back.add("w", {2});
  load_weights(dir / "nested" / "new", back.list);
  write_raw(dir / "file", "x");
  expect_error([&] { save_model(dir / "file", tiny_config(), ps.list); }, {(dir / "file").string()});
}

// Files written by the Python reference (tests/reference/safetensors_io.py): our reader must
// accept them, and re-saving their weights must reproduce them bit for bit.
TEST(Checkpoint, ReadsAndRewritesThePythonFixtures) {
  const fs::path fixtures = fs::path(MOE_SOURCE_DIR) / "tests" / "fixtures";
  if (!fs::exists(fixtures / "v2_softmax" / "model.safetensors")) GTEST_SKIP() << "no fixtures";
  const fs::path out = scratch_dir();
  for (const char* name : {"v3_sigmoid_groups", "v2_softmax", "zero_token_experts", "single_token_seqs"}) {
    const fs::path dir = fixtures / name;
    if (!fs::exists(dir / "config.json")) continue;
    SCOPED_TRACE(name);
    const ModelConfig cfg = read_hf_config(dir);
    expect_lossless_round_trip(cfg);
    const SafetensorsReader expected(dir / "expected.safetensors");
    EXPECT_EQ(expected.entry("tokens").dtype, "I32");

    const SafetensorsSet weights(dir);
    ParamSet ps;
    for (const auto& key : weights.names()) ps.add(key, weights.reader_for(key).entry(key).shape);
    load_weights(weights, ps.list);
    save_model(out / name, cfg, ps.list, DType::F32);
    ParamSet again;
    for (Param* p : ps.list) again.add(p->name, p->value.shape());
    load_weights(out / name, again.list);
    for (size_t i = 0; i < ps.list.size(); ++i)
      ASSERT_TRUE(same_bytes(again.list[i]->value, ps.list[i]->value)) << ps.list[i]->name;
    expect_same_config(read_hf_config(out / name), cfg);
  }
}
