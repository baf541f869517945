// A safetensors file: the 8-byte header length, the JSON header, then every tensor read back in
// each dtype it may load as (the conversions stream through their own buffer).
#include "fuzz_util.h"
#include "io/safetensors.h"

using namespace moe;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::MemoryFile file(fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const SafetensorsReader reader(file.path());
    for (const auto& [key, value] : reader.metadata()) (void)key.size(), (void)value.size();
    for (const SafetensorsEntry& e : reader.entries()) {
      if (reader.find(e.name) != &e) fuzz::finding("find() does not return the entry of '" + e.name + "'");
      for (DType want : {DType::F32, DType::BF16, DType::I32, DType::U8})
        fuzz::expect_ok_or_error([&] { (void)reader.read(e.name, want); });
      if (e.nbytes() > 0)
        fuzz::expect_ok_or_error([&] {
          unsigned char last = 0;
          reader.read_bytes(e, e.nbytes() - 1, 1, &last);
        });
    }
  });
  return 0;
}
