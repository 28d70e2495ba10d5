// A method of a bound class that reads its positional arguments with the Python C API (METH_FASTCALL) instead of
// pybind11's dispatcher, for the few crossings made once per collective call: pybind11 converts a 34-argument call
// with its 16 agreement words in about a microsecond more than this does. FastArgs reads the arguments in order and
// raises TypeError naming the method and the argument's position, as pybind11 would refuse them.
//
//   PyObject* f(PyObject* self, PyObject* const* args, Py_ssize_t n) {
//     return fast_method_body("C.f", n, 3, [&](FastArgs& a) { ... return py::object; }, args);
//   }
//   add_fast_method(cls, def);   // def: a static PyMethodDef with METH_FASTCALL
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include <array>
#include <climits>
#include <cstdint>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

namespace dc::bindings {

class FastArgs {
 public:
  FastArgs(const char* method, PyObject* const* args) : method_(method), args_(args) {}

  int64_t i64() { return int64_t(as_long_long(next())); }
  int i32() {
    const long long v = as_long_long(next());
    if (v < INT_MIN || v > INT_MAX) fail("does not fit a 32-bit int");
    return int(v);
  }
  uint64_t u64() {  // pointers, streams, events, tags: non-negative ints
    PyObject* o = next();
    if (!PyLong_Check(o)) fail("must be an int");
    const unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      fail("must be a non-negative int below 2**64");
    }
    return uint64_t(v);
  }
  bool boolean() {
    PyObject* o = next();
    if (!PyBool_Check(o)) fail("must be a bool");
    return o == Py_True;
  }
  double f64() {
    PyObject* o = next();
    if (!PyFloat_Check(o) && !PyLong_Check(o)) fail("must be a float");
    const double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) throw pybind11::error_already_set();
    return v;
  }
  // a sequence of exactly N ints, each fitting an int32 (a call's agreement words)
  template <size_t N>
  std::array<int32_t, N> ints() {
    PyObject* o = next();
    pybind11::object seq = pybind11::reinterpret_steal<pybind11::object>(PySequence_Fast(o, ""));
    if (!seq) {
      PyErr_Clear();
      fail("must be a sequence of ints");
    }
    if (PySequence_Fast_GET_SIZE(seq.ptr()) != Py_ssize_t(N)) fail("must hold " + std::to_string(N) + " ints");
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    std::array<int32_t, N> out{};
    for (size_t i = 0; i < N; ++i) {
      const long long v = as_long_long(items[i]);
      if (v < INT32_MIN || v > INT32_MAX) fail("holds a value that does not fit an int32");
      out[i] = int32_t(v);
    }
    return out;
  }
  // an instance of a pybind11-bound class
  template <class T>
  T& object() {
    PyObject* o = next();
    try {
      return pybind11::handle(o).cast<T&>();
    } catch (const pybind11::builtin_exception&) {  // cast_error, reference_cast_error
      fail(std::string("must be a ") + pybind11::type_id<T>());
    }
  }

 private:
  PyObject* next() { return args_[at_++]; }
  long long as_long_long(PyObject* o) {
    if (!PyLong_Check(o)) fail("must be an int");
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      fail("does not fit a 64-bit int");
    }
    return v;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw pybind11::type_error(std::string(method_) + ": argument " + std::to_string(at_) + " " + what);
  }

  const char* method_;
  PyObject* const* args_;
  Py_ssize_t at_ = 0;
};

// Runs `body(FastArgs&)` (which returns a pybind11::object) after checking the argument count; a C++ exception
// leaves as the Python exception pybind11's default translation gives it (no custom translators are registered).
template <class Body>
PyObject* fast_method_body(const char* method, Py_ssize_t nargs, Py_ssize_t expected, Body&& body,
                           PyObject* const* args) {
  try {
    if (nargs != expected)
      throw pybind11::type_error(std::string(method) + ": takes " + std::to_string(expected) +
                                 " positional arguments, got " + std::to_string(nargs));
    FastArgs a(method, args);
    return body(a).release().ptr();
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const pybind11::builtin_exception& e) {  // type_error, value_error, ...
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::overflow_error& e) {
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::logic_error& e) {  // invalid_argument (DC_HOST_ASSERT), domain_error, length_error
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
  return nullptr;
}

// Installs `def` (METH_FASTCALL, static lifetime) as a method of the bound class `cls`.
inline void add_fast_method(pybind11::handle cls, PyMethodDef* def) {
  PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), def);
  if (descr == nullptr) throw pybind11::error_already_set();
  pybind11::setattr(cls, def->ml_name, pybind11::reinterpret_steal<pybind11::object>(descr));
}

}  // namespace dc::bindings
