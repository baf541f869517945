#include "core/tensor.h"

#include <cstdlib>
#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace moe {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
  }
  return "?";
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Storage::Storage(int64_t bytes, MemCategory category) : bytes_(bytes), category_(category) {
  if (bytes > 0) {
    // 64-byte alignment (at least) lets SIMD kernels use aligned loads on row starts.
    try {
      block_ = allocate_block(static_cast<size_t>(bytes));
    } catch (const Error&) {
      fail("out of memory allocating {} for {}", format_bytes(bytes), mem_category_name(category));
    }
    data_ = block_.data;
  }
  MemoryTracker::instance().on_alloc(category_, bytes_);
}

Storage::~Storage() {
  free_block(block_);
  MemoryTracker::instance().on_free(category_, bytes_);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, MemCategory category) {
  for (auto d : shape) MOE_CHECK(d >= 0, "negative tensor dimension in shape {}", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(shape_numel(shape) * dtype_size(dtype), category);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemCategory category) {
  Tensor t = empty(shape, dtype, category);
  t.zero();
  return t;
}

float* Tensor::f32() const {
  MOE_CHECK(dtype_ == DType::F32, "expected an F32 tensor, got {}", dtype_name(dtype_));
  return static_cast<float*>(raw());
}
uint16_t* Tensor::bf16() const {
  MOE_CHECK(dtype_ == DType::BF16, "expected a BF16 tensor, got {}", dtype_name(dtype_));
  return static_cast<uint16_t*>(raw());
}
int32_t* Tensor::i32() const {
  MOE_CHECK(dtype_ == DType::I32, "expected an I32 tensor, got {}", dtype_name(dtype_));
  return static_cast<int32_t*>(raw());
}
uint8_t* Tensor::u8() const {
  MOE_CHECK(dtype_ == DType::U8, "expected a U8 tensor, got {}", dtype_name(dtype_));
  return static_cast<uint8_t*>(raw());
}

Tensor Tensor::view(const Shape& shape) const {
  MOE_CHECK(shape_numel(shape) == numel(), "cannot view {} as {}", shape_str(shape_),
            shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::narrow(int64_t begin, int64_t length) const {
  MOE_CHECK(ndim() >= 1 && begin >= 0 && length >= 0 && begin + length <= shape_[0],
            "cannot narrow {} to rows [{}, {})", shape_str(shape_), begin, begin + length);
  Tensor t = *this;
  t.shape_[0] = length;
  t.offset_bytes_ += begin * (numel() / std::max<int64_t>(shape_[0], 1)) * dtype_size(dtype_);
  return t;
}

void Tensor::zero() const {
  if (raw()) std::memset(raw(), 0, static_cast<size_t>(nbytes()));
}

Tensor Tensor::clone(MemCategory category) const {
  Tensor t = empty(shape_, dtype_, category);
  if (nbytes()) std::memcpy(t.raw(), raw(), static_cast<size_t>(nbytes()));
  return t;
}

void Tensor::copy_from(const Tensor& other) const {
  MOE_CHECK(other.shape_ == shape_, "copy shape mismatch: {} vs {}", shape_str(other.shape_),
            shape_str(shape_));
  const int64_t n = numel();
  if (other.dtype_ == dtype_) {
    if (n) std::memcpy(raw(), other.raw(), static_cast<size_t>(nbytes()));
  } else if (other.dtype_ == DType::BF16 && dtype_ == DType::F32) {
    const uint16_t* s = other.bf16();
    float* d = f32();
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  } else if (other.dtype_ == DType::F32 && dtype_ == DType::BF16) {
    const float* s = other.f32();
    uint16_t* d = bf16();
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
  } else {
    fail("unsupported conversion {} -> {}", dtype_name(other.dtype_), dtype_name(dtype_));
  }
}

Tensor Tensor::to(DType dtype, MemCategory category) const {
  Tensor t = empty(shape_, dtype, category);
  t.copy_from(*this);
  return t;
}

}  // namespace moe
