#pragma once
// A contiguous, reference-counted buffer with a shape, a dtype and a memory category.
// Zero-sized tensors are ordinary (an expert with no tokens has a [0, dim] input).
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/block_cache.h"
#include "core/dtype.h"
#include "core/memory.h"

namespace moe {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Storage {
 public:
  Storage(int64_t bytes, MemCategory category);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }

 private:
  HostBlock block_;
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  MemCategory category_;
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised contents.
  static Tensor empty(const Shape& shape, DType dtype, MemCategory category);
  static Tensor zeros(const Shape& shape, DType dtype, MemCategory category);
  static Tensor f32(const Shape& shape, MemCategory category) {
    return zeros(shape, DType::F32, category);
  }

  bool defined() const { return storage_ != nullptr; }
  void reset() { storage_.reset(), shape_.clear(), offset_bytes_ = 0; }
  const Shape& shape() const { return shape_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const { return shape_[static_cast<size_t>(i < 0 ? i + ndim() : i)]; }
  int64_t numel() const { return shape_numel(shape_); }
  int64_t nbytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  MemCategory category() const { return storage_ ? storage_->category() : MemCategory::Scratch; }

  void* raw() const {
    return storage_ && storage_->data() ? static_cast<char*>(storage_->data()) + offset_bytes_ : nullptr;
  }
  float* f32() const;
  uint16_t* bf16() const;
  int32_t* i32() const;
  uint8_t* u8() const;

  // Same storage, another shape with the same element count.
  Tensor view(const Shape& shape) const;
  // Rows [begin, begin + length) along dim 0, sharing storage (e.g. one expert of [E, out, in]).
  Tensor narrow(int64_t begin, int64_t length) const;
  void zero() const;
  Tensor clone(MemCategory category) const;
  // F32 <-> BF16 (or same-type copy) into a new tensor.
  Tensor to(DType dtype, MemCategory category) const;
  void copy_from(const Tensor& other) const;

 private:
  std::shared_ptr<Storage> storage_;
  Shape shape_;
  DType dtype_ = DType::F32;
  int64_t offset_bytes_ = 0;
};

}  // namespace moe
