// The DLPack exchange ABI (unversioned form, capsule name "dltensor"): how a tensor described by a pointer, a shape
// and strides crosses to a framework without either side linking the other. Only the fields deepcomm fills are
// named; the layouts are the standard's, which every consumer (torch.from_dlpack among them) reads. Below it, the
// standard's C exchange table (DLPack 1.2+, `type(tensor).__dlpack_c_exchange_api__`): the framework's own functions
// that describe one of its Python tensors as a Tensor, or give its current stream, without Python in between.
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

struct Version {
  uint32_t major;
  uint32_t minor;
};

struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  uint64_t flags;
  Tensor dl_tensor;
};

struct ExchangeApiHeader {
  Version version;               // a consumer checks the major version before using the table
  ExchangeApiHeader* prev_api;   // an older table, or null
};

// Each function returns 0, or -1 with a Python exception set; none synchronizes a stream.
struct ExchangeApi {
  ExchangeApiHeader header;
  int (*managed_tensor_allocator)(Tensor* prototype, ManagedTensorVersioned** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind, const char* message));
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, ManagedTensorVersioned** out);
  int (*managed_tensor_to_py_object_no_sync)(ManagedTensorVersioned* tensor, void** out_py_object);
  // a non-owning description of `py_object` (of the type the table came from), valid until control returns to
  // Python; may be null where a framework does not offer it
  int (*dltensor_from_py_object_no_sync)(void* py_object, Tensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_current_stream);
};

inline constexpr uint32_t kExchangeApiMajor = 1;  // the major version of the table above
inline constexpr const char* kExchangeApiCapsuleName = "dlpack_exchange_api";

inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";  // renamed so by a consumer that took it

}  // namespace dc::dlpack
