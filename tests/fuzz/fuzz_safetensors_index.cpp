// model.safetensors.index.json in a model directory that also holds one small valid shard, read
// both ways a load does: the index alone (read_safetensors_index) and the set that opens shards
// on demand (SafetensorsSet), every tensor it names looked up.
#include "fuzz_util.h"
#include "io/safetensors.h"

using namespace moe;

namespace {

const std::filesystem::path& model_dir() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path d = fuzz::scratch_dir() / "model";
    std::filesystem::create_directories(d / "sub");
    const Tensor t = Tensor::zeros({2, 3}, DType::F32, MemCategory::Weights);
    write_safetensors(d / "model-00001-of-00002.safetensors", {{"model.embed_tokens.weight", t}});
    write_safetensors(d / "sub" / "model-00002-of-00002.safetensors", {{"lm_head.weight", t}});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path& dir = model_dir();
  fuzz::write_file(dir / kSafetensorsIndexFile, fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const SafetensorsIndex index = read_safetensors_index(dir);
    if (!index.sharded) fuzz::finding("an index directory read as a single file");
  });
  fuzz::expect_ok_or_error([&] {
    const SafetensorsSet set(dir);
    int looked_up = 0;
    for (const std::string& name : set.names()) {
      if (++looked_up > 64) break;
      fuzz::expect_ok_or_error([&] {
        if (set.contains(name)) (void)set.reader_for(name);
      });
    }
    (void)set.open_files();
  });
  return 0;
}
