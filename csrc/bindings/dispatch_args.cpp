// deepcomm._C.DispatchArgReader: a plain normal-mode call's arguments (a fresh or cached dispatch, a combine)
// checked and read in one crossing, with its fingerprint (deepcomm/agreement.py) made from them: what the Buffer's
// checks (deepcomm/validation.py), agreement.dispatch / agreement.combine and the NVLink backend's reads of the
// tensors cost in Python, host time of every call (docs/benchmarks/README.md, the host split). Each tensor is described
// by torch's own C function of the DLPack exchange table (runtime/dlpack_abi.hpp ExchangeApi): no Python attribute
// read, no allocation, and nothing of libtorch linked.
//
// The reader only accepts: a call it accepts is one the Python checks accept, and what it reads is what they read.
// Anything else (a tensor subclass, a wrong dtype, a CUDA graph being captured, ...) gives None, and the Buffer
// then takes its Python path, whose checks name what is wrong. tests/api/test_dispatch_arg_reader.py holds the two
// to each other.
#include <Python.h>
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <climits>
#include <cstdint>
#include <string>

#include "../runtime/dlpack_abi.hpp"
#include "exchange_table.hpp"
#include "fast_method.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

namespace {

constexpr int kMaxWords = 64;

// Where agreement.make puts each word of a fingerprint, and the codes it writes: given by Python
// (deepcomm/cuda/arg_reader.py), whose agreement module is the one definition of the layout.
struct FingerprintLayout {
  int words = 0;
  long long magic = 0, call_mask = 0, op_dispatch = 0, op_combine = 0;
  int magic_at = 0, op_at = 0, call_at = 0, buffer_at = 0, hidden_at = 0, dtype_at = 0, scales_at = 0,
      topk_at = 0, weights_at = 0, experts_at = 0, handle_at = 0, use_fp8_at = 0, num_sms_at = 0;
  long long bf16_code = 0, fp8_code = 0, scales_fp32 = 0, scales_ue8m0 = 0;
};

// What one call's words hold (the others are 0).
struct CallWords {
  long long op = 0, call = 0, buffer = 0, hidden = 0, dtype = 0, scales = 0, topk = 0, weights = 0, experts = 0,
            handle = 0, use_fp8 = 0;
};

// The limits of the checks (deepcomm/validation.py), for one Buffer.
struct ReaderLimits {
  int num_ranks = 1;
  int device = -1;  // the Buffer's CUDA device index; -1: its tensors live on the CPU
  long long max_hidden = 0, max_tokens = 0;
  int row_align = 8, data_align = 16, max_topk = 32, block = 128;
};

// One tensor as its framework describes it: exactly of the table's tensor type, at most two dimensions.
struct Described {
  dlpack::DataType dtype{};
  int dims = 0;
  int64_t size[2] = {0, 0};
  bool contiguous = false;
  dlpack::Device device{};
  uintptr_t ptr = 0;
};

// A dispatch's payload: x, or the FP8 pair's values and scales.
struct Payload {
  Described values, scales;
  bool fp8 = false;
  long long scale_code = 0;  // the SCALES word
};

bool same_dtype(const dlpack::DataType& a, const dlpack::DataType& b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

bool as_long(PyObject* o, long long& out) {
  if (!PyLong_Check(o)) return false;
  out = PyLong_AsLongLong(o);
  if (out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

class DispatchArgReader {
 public:
  // api: the capsule of torch.Tensor.__dlpack_c_exchange_api__; samples: dtype name -> an empty tensor of it (its
  // DLPack type is asked of the table, so no type code is written here); current_stream: None (the table's query
  // on a CUDA device, 0 on the CPU) or a callable taking the device index (tests' stand-ins).
  DispatchArgReader(py::capsule api, py::handle tensor_type, py::dict samples, py::dict limits, py::dict layout,
                    py::object current_stream)
      : type_(reinterpret_cast<PyTypeObject*>(tensor_type.ptr())),
        type_ref_(py::reinterpret_borrow<py::object>(tensor_type)), current_stream_(std::move(current_stream)) {
    api_ = exchange_table(api);
    if (api_ == nullptr || api_->dltensor_from_py_object_no_sync == nullptr || api_->current_work_stream == nullptr)
      throw py::value_error("DispatchArgReader: not a DLPack exchange table of major version 1, or one without "
                            "dltensor_from_py_object_no_sync");
    bf16_ = sample_type(samples, "bfloat16"); fp8_ = sample_type(samples, "float8_e4m3fn");
    f32_ = sample_type(samples, "float32"); i32_ = sample_type(samples, "int32"); i64_ = sample_type(samples, "int64");
    bf16_dtype_ = samples["bfloat16"].attr("dtype"); fp8_dtype_ = samples["float8_e4m3fn"].attr("dtype");
    f32_dtype_ = samples["float32"].attr("dtype"); i32_dtype_ = samples["int32"].attr("dtype");
    lim_.num_ranks = limits["num_ranks"].cast<int>(); lim_.device = limits["device"].cast<int>();
    lim_.max_hidden = limits["max_hidden"].cast<long long>(); lim_.max_tokens = limits["max_tokens"].cast<long long>();
    lim_.row_align = limits["row_align"].cast<int>(); lim_.data_align = limits["data_align"].cast<int>();
    lim_.max_topk = limits["max_topk"].cast<int>(); lim_.block = limits["block"].cast<int>();
    if (lim_.num_ranks < 1 || lim_.row_align < 1 || lim_.data_align < 1 || lim_.block < 1)
      throw py::value_error("DispatchArgReader: num_ranks, row_align, data_align and block must be >= 1");
    device_ = lim_.device >= 0 ? dlpack::Device{dlpack::kCUDA, lim_.device} : dlpack::Device{dlpack::kCPU, 0};
    FingerprintLayout& f = fp_;
    f.words = layout["words"].cast<int>();
    if (f.words < 1 || f.words > kMaxWords) throw py::value_error("DispatchArgReader: a fingerprint of 1..64 words");
    f.magic = layout["magic"].cast<long long>(); f.call_mask = layout["call_mask"].cast<long long>();
    f.op_dispatch = layout["op_dispatch"].cast<long long>(); f.op_combine = layout["op_combine"].cast<long long>();
    py::dict at = layout["at"];
    f.magic_at = at["MAGIC"].cast<int>(); f.op_at = at["OP"].cast<int>(); f.call_at = at["CALL"].cast<int>();
    f.buffer_at = at["BUFFER"].cast<int>(); f.hidden_at = at["HIDDEN"].cast<int>();
    f.dtype_at = at["X_DTYPE"].cast<int>(); f.scales_at = at["SCALES"].cast<int>(); f.topk_at = at["TOPK"].cast<int>();
    f.weights_at = at["WEIGHTS"].cast<int>(); f.experts_at = at["NUM_EXPERTS"].cast<int>();
    f.handle_at = at["HANDLE"].cast<int>(); f.use_fp8_at = at["USE_FP8"].cast<int>();
    f.num_sms_at = at["NUM_SMS"].cast<int>();
    f.bf16_code = layout["bf16_code"].cast<long long>(); f.fp8_code = layout["fp8_code"].cast<long long>();
    f.scales_fp32 = layout["scales_fp32"].cast<long long>();
    f.scales_ue8m0 = layout["scales_ue8m0"].cast<long long>();
    for (int i : {f.magic_at, f.op_at, f.call_at, f.buffer_at, f.hidden_at, f.dtype_at, f.scales_at, f.topk_at,
                  f.weights_at, f.experts_at, f.handle_at, f.use_fp8_at, f.num_sms_at})
      if (i < 0 || i >= f.words) throw py::value_error("DispatchArgReader: a word index is outside the fingerprint");
  }

  // fresh(x, topk_idx, topk_weights, num_experts, call, buffer): a dispatch without a handle. None, or (T, H, K,
  // caller stream, x's dtype, the scales' dtype or None, x_row_bytes, scale_row_bytes, x ptr, scales ptr, topk_idx
  // ptr, topk_weights ptr, whether topk_weights is given, fingerprint words). A pointer of an empty tensor may be
  // 0: presence is said.
  py::object fresh(PyObject* const* args) const {
    PyObject *idx = args[1], *weights = args[2], *experts = args[3];
    Payload p;
    Described t, w;
    if (!read_payload(args[0], p)) return py::none();
    const long long T = p.values.size[0];
    if (!describe(idx, t) || !same_dtype(t.dtype, i64_) || t.dims != 2 || t.size[0] != T ||
        t.size[1] > lim_.max_topk || !placed(t))
      return py::none();
    const bool with_weights = weights != Py_None;
    if (with_weights && !weights_ok(weights, w, T, t.size[1])) return py::none();
    long long E = 0;
    if (!PyLong_CheckExact(experts) || !as_long(experts, E) || E < 1 || E % lim_.num_ranks != 0 || E > INT32_MAX)
      return py::none();
    CallWords c;
    c.op = fp_.op_dispatch;
    c.topk = t.size[1];
    c.experts = E;
    return dispatch_read(p, t.size[1], t.ptr, w, with_weights, c, args[4], args[5]);
  }

  // cached(x, topk_weights, num_tokens, num_experts, handle_call, call, buffer): a dispatch with a handle (its
  // num_tokens, num_experts and call number), without topk_idx (which the Python path checks by value). None, or
  // fresh's tuple (topk_idx ptr 0).
  py::object cached(PyObject* const* args) const {
    PyObject* weights = args[1];
    long long T = 0, E = 0, handle_call = 0;
    if (!as_long(args[2], T) || !as_long(args[3], E) || !as_long(args[4], handle_call))
      throw py::type_error("cached: num_tokens, num_experts and handle_call are ints");
    Payload p;
    Described w;
    if (!read_payload(args[0], p) || p.values.size[0] != T) return py::none();
    const bool with_weights = weights != Py_None;
    if (with_weights && !weights_ok(weights, w, T, -1)) return py::none();
    const long long K = with_weights ? w.size[1] : 0;
    CallWords c;
    c.op = fp_.op_dispatch;
    c.topk = K;
    c.experts = E;
    c.handle = handle_call & fp_.call_mask;
    return dispatch_read(p, K, 0, w, with_weights, c, args[5], args[6]);
  }

  // combine(x, topk_weights, num_recv, use_fp8, handle_call, call, buffer): a combine of a handle (its num_recv and
  // call number). None, or (N, H, K, caller stream, x ptr, topk_weights ptr, whether topk_weights is given,
  // use_fp8, fingerprint words).
  py::object combine(PyObject* const* args) const {
    PyObject *weights = args[1], *use_fp8 = args[3];
    long long N = 0, handle_call = 0;
    if (!as_long(args[2], N) || !as_long(args[4], handle_call))
      throw py::type_error("combine: num_recv and handle_call are ints");
    if (!PyBool_Check(use_fp8)) return py::none();
    const bool fp8 = use_fp8 == Py_True;
    Described x, w;
    if (!describe(args[0], x) || !same_dtype(x.dtype, bf16_) || x.dims != 2 || x.size[0] != N || !placed(x) ||
        x.size[1] % (fp8 ? lim_.block : lim_.row_align) != 0 || x.size[1] > lim_.max_hidden ||
        x.ptr % uintptr_t(lim_.data_align) != 0)
      return py::none();
    const bool with_weights = weights != Py_None;
    if (with_weights && !weights_ok(weights, w, N, -1)) return py::none();
    uintptr_t caller = 0;
    if (!caller_stream(caller)) return py::none();
    const long long K = with_weights ? w.size[1] : 0;
    CallWords c;
    c.op = fp_.op_combine;
    c.hidden = x.size[1];
    c.dtype = fp_.bf16_code;
    c.topk = K;
    c.weights = with_weights;
    c.handle = handle_call & fp_.call_mask;
    c.use_fp8 = fp8;
    py::tuple words = make_words(c, args[5], args[6]);
    return py::make_tuple(N, x.size[1], K, caller, x.ptr, with_weights ? w.ptr : 0, with_weights, fp8,
                          std::move(words));
  }

  // The num_sms the words of later calls carry (Buffer.set_num_sms keeps it the Buffer's).
  void set_num_sms(long long num_sms) { num_sms_ = num_sms; }

 private:
  dlpack::DataType sample_type(py::dict samples, const char* name) const {
    dlpack::Tensor d{};
    py::object sample = samples[name];
    if (Py_TYPE(sample.ptr()) != type_ || api_->dltensor_from_py_object_no_sync(sample.ptr(), &d) != 0)
      throw py::value_error(std::string("DispatchArgReader: the sample of ") + name + " cannot be described");
    return d.dtype;
  }
  // `o` described by its framework: false for another type (a subclass may not be what the table describes), a
  // tensor the table refuses (the error cleared) or more than two dimensions
  bool describe(PyObject* o, Described& a) const {
    if (o == nullptr || Py_TYPE(o) != type_) return false;
    dlpack::Tensor d{};
    if (api_->dltensor_from_py_object_no_sync(o, &d) != 0) {
      PyErr_Clear();
      return false;
    }
    if (d.ndim < 0 || d.ndim > 2) return false;
    a.dtype = d.dtype;
    a.dims = d.ndim;
    a.size[0] = a.size[1] = 0;
    int64_t numel = 1;
    for (int i = 0; i < d.ndim; ++i) numel *= (a.size[i] = d.shape[i]);
    // torch's rule (TensorImpl::compute_contiguous): row-major strides, a dimension of size 1 or an empty tensor
    // taking any
    a.contiguous = true;
    if (numel != 0 && d.strides != nullptr) {
      int64_t expected = 1;
      for (int i = d.ndim - 1; i >= 0; --i) {
        if (d.shape[i] == 1) continue;
        if (d.strides[i] != expected) {
          a.contiguous = false;
          break;
        }
        expected *= d.shape[i];
      }
    }
    a.device = d.device;
    a.ptr = reinterpret_cast<uintptr_t>(d.data) + uintptr_t(d.byte_offset);
    return true;
  }
  // topk_weights: float32 [rows, cols] (cols -1: any up to max_topk), contiguous on the device
  bool weights_ok(PyObject* weights, Described& w, long long rows, long long cols) const {
    return describe(weights, w) && same_dtype(w.dtype, f32_) && w.dims == 2 && w.size[0] == rows &&
           (cols >= 0 ? w.size[1] == cols : w.size[1] <= lim_.max_topk) && placed(w);
  }
  bool placed(const Described& a) const {  // contiguous and on the Buffer's device
    return a.contiguous && a.device.device_type == device_.device_type && a.device.device_id == device_.device_id;
  }
  // x or the FP8 pair (a tuple or list of two): 2-D rows of the Buffer's sizes, contiguous on the device, 16-byte
  // aligned; the scales fp32 [T, H/128] or UE8M0-packed int32 [T, H/512]
  bool read_payload(PyObject* x, Payload& p) const {
    PyObject *values = x, *scales = nullptr;
    if (PyTuple_Check(x) || PyList_Check(x)) {
      if (PySequence_Fast_GET_SIZE(x) != 2) return false;
      PyObject** items = PySequence_Fast_ITEMS(x);
      values = items[0];
      scales = items[1];
    }
    p.fp8 = scales != nullptr;
    const Described& v = p.values;
    if (!describe(values, p.values) || !same_dtype(v.dtype, p.fp8 ? fp8_ : bf16_) || v.dims != 2 || !placed(v))
      return false;
    const long long H = v.size[1];
    if (H % (p.fp8 ? lim_.block : lim_.row_align) != 0 || H > lim_.max_hidden || v.size[0] > lim_.max_tokens ||
        v.ptr % uintptr_t(lim_.data_align) != 0)
      return false;
    if (!p.fp8) return true;
    const Described& s = p.scales;
    if (!describe(scales, p.scales) || s.dims != 2 || s.size[0] != v.size[0] || !placed(s)) return false;
    if (same_dtype(s.dtype, f32_) && s.size[1] == H / lim_.block) p.scale_code = fp_.scales_fp32;
    else if (same_dtype(s.dtype, i32_) && H % (4 * lim_.block) == 0 && s.size[1] == H / (4 * lim_.block))
      p.scale_code = fp_.scales_ue8m0;
    return p.scale_code != 0;
  }
  // a dispatch's tuple (fresh's) once its payload, topk_idx and topk_weights were read
  py::object dispatch_read(const Payload& p, long long K, uintptr_t idx_ptr, const Described& w, bool with_weights,
                           CallWords& c, PyObject* call, PyObject* buffer) const {
    uintptr_t caller = 0;
    if (!caller_stream(caller)) return py::none();
    const long long T = p.values.size[0], H = p.values.size[1];
    c.hidden = H;
    c.dtype = p.fp8 ? fp_.fp8_code : fp_.bf16_code;
    c.scales = p.scale_code;
    c.weights = with_weights;
    py::tuple words = make_words(c, call, buffer);
    const long long x_row_bytes = p.fp8 ? H : 2 * H;
    const long long scale_row_bytes = p.fp8 ? p.scales.size[1] * 4 : 0;
    const py::object& x_dtype = p.fp8 ? fp8_dtype_ : bf16_dtype_;
    py::object scales_dtype = py::none();
    if (p.fp8) scales_dtype = p.scale_code == fp_.scales_fp32 ? f32_dtype_ : i32_dtype_;
    return py::make_tuple(T, H, K, caller, x_dtype, scales_dtype, x_row_bytes, scale_row_bytes, p.values.ptr,
                          p.fp8 ? p.scales.ptr : 0, idx_ptr, with_weights ? w.ptr : 0, with_weights,
                          std::move(words));
  }
  // the call's words in agreement's layout (MAGIC, the call's number masked, the Buffer's number, the rest of `c`)
  py::tuple make_words(const CallWords& c, PyObject* call, PyObject* buffer) const {
    long long call_no = 0, buffer_no = 0;
    if (!as_long(call, call_no) || !as_long(buffer, buffer_no)) throw py::type_error("call and buffer are ints");
    long long word[kMaxWords] = {};
    word[fp_.magic_at] = fp_.magic;
    word[fp_.op_at] = c.op;
    word[fp_.call_at] = call_no & fp_.call_mask;
    word[fp_.buffer_at] = buffer_no;
    word[fp_.hidden_at] = c.hidden;
    word[fp_.dtype_at] = c.dtype;
    word[fp_.scales_at] = c.scales;
    word[fp_.topk_at] = c.topk;
    word[fp_.weights_at] = c.weights;
    word[fp_.experts_at] = c.experts;
    word[fp_.handle_at] = c.handle;
    word[fp_.use_fp8_at] = c.use_fp8;
    word[fp_.num_sms_at] = num_sms_;
    py::tuple words(fp_.words);
    for (int i = 0; i < fp_.words; ++i) {
      PyObject* item = PyLong_FromLongLong(word[i]);
      if (item == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(words.ptr(), i, item);
    }
    return words;
  }
  // The caller's current stream, and on a CUDA device whether it is free of a CUDA graph capture: a fresh dispatch
  // reads its counts back, which a capture forbids (the Python path raises naming num_worst_tokens), and the calls
  // captured in a graph keep the Python path's order on the capture stream. Tensors on the CPU (device -1, tests)
  // are never captured.
  bool caller_stream(uintptr_t& caller) const {
    if (!current_stream_.is_none()) {
      PyObject* got = PyObject_CallOneArg(current_stream_.ptr(), py::int_(lim_.device).ptr());
      long long stream = 0;
      const bool ok = got != nullptr && as_long(got, stream);
      Py_XDECREF(got);
      if (!ok) {
        PyErr_Clear();
        return false;
      }
      caller = uintptr_t(stream);
    } else if (lim_.device >= 0) {
      void* stream = nullptr;
      if (api_->current_work_stream(dlpack::kCUDA, lim_.device, &stream) != 0) {
        PyErr_Clear();
        return false;
      }
      caller = reinterpret_cast<uintptr_t>(stream);
    }
    if (lim_.device < 0) return true;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(caller), &status) != cudaSuccess) {
      (void)cudaGetLastError();  // e.g. the legacy stream while another stream captures: left to the Python path
      return false;
    }
    return status == cudaStreamCaptureStatusNone;
  }

  const dlpack::ExchangeApi* api_ = nullptr;
  PyTypeObject* type_;
  py::object type_ref_;  // keeps the tensor type alive with the reader
  py::object current_stream_;
  dlpack::DataType bf16_{}, fp8_{}, f32_{}, i32_{}, i64_{};
  py::object bf16_dtype_, fp8_dtype_, f32_dtype_, i32_dtype_;  // the torch.dtype objects a read names
  dlpack::Device device_{};
  ReaderLimits lim_;
  FingerprintLayout fp_;
  long long num_sms_ = 0;  // the Buffer's num_sms: every call's NUM_SMS word
};

template <py::object (DispatchArgReader::*Read)(PyObject* const*) const>
PyObject* reader_method(PyObject* self, PyObject* const* args, Py_ssize_t nargs, const char* name, int expected) {
  return fast_method_body(name, nargs, expected, [&](FastArgs&) -> py::object {
    return (py::handle(self).cast<const DispatchArgReader&>().*Read)(args);
  }, args);
}

PyObject* reader_fresh(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return reader_method<&DispatchArgReader::fresh>(self, args, nargs, "DispatchArgReader.fresh", 6);
}
PyObject* reader_cached(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return reader_method<&DispatchArgReader::cached>(self, args, nargs, "DispatchArgReader.cached", 7);
}
PyObject* reader_combine(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return reader_method<&DispatchArgReader::combine>(self, args, nargs, "DispatchArgReader.combine", 7);
}

template <PyObject* (*F)(PyObject*, PyObject* const*, Py_ssize_t)>
PyCFunction fast_cfunction() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(F));
}

PyMethodDef reader_defs[] = {
    {"fresh", fast_cfunction<&reader_fresh>(), METH_FASTCALL, "DispatchArgReader.fresh (dispatch_args.cpp)"},
    {"cached", fast_cfunction<&reader_cached>(), METH_FASTCALL, "DispatchArgReader.cached (dispatch_args.cpp)"},
    {"combine", fast_cfunction<&reader_combine>(), METH_FASTCALL, "DispatchArgReader.combine (dispatch_args.cpp)"},
};

}  // namespace

void register_dispatch_args(py::module_& m) {
  py::class_<DispatchArgReader> reader(m, "DispatchArgReader");
  reader.def(py::init<py::capsule, py::handle, py::dict, py::dict, py::dict, py::object>(), py::arg("api"),
             py::arg("tensor_type"), py::arg("samples"), py::arg("limits"), py::arg("fingerprint"),
             py::arg("current_stream"));
  for (PyMethodDef& def : reader_defs) add_fast_method(reader, &def);
  reader.def("set_num_sms", &DispatchArgReader::set_num_sms, py::arg("num_sms"),
             "The num_sms the words of later calls carry (agreement.Word.NUM_SMS).");
}

}  // namespace dc::bindings
