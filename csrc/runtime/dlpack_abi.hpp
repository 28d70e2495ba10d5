// The DLPack exchange ABI (unversioned form, capsule name "dltensor"): how a tensor described by a pointer, a shape
// and strides crosses to a framework without either side linking the other. Only the fields deepcomm fills are
// named; the layouts are the standard's, which every consumer (torch.from_dlpack among them) reads.
#pragma once
#include <cstdint>

namespace dc::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2 };
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);  // called by the consumer when it no longer needs the memory
};

inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";  // renamed so by a consumer that took it

}  // namespace dc::dlpack
