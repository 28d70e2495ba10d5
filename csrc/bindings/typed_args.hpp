// Typed argument structs for Python: bind a plain struct S whose fields are read and written by name
// (def_readwrite) and which Python builds with every field as a keyword, S(name=value, ...). The constructor
// refuses an unknown or missing field (TypeError naming it), converts each value to the field's C++ type (TypeError
// naming the field when it cannot), then runs S::check() (ValueError naming the bad field). FIELDS lists the names.
//
//   ArgsClass<S>(m, "S", "doc").field("a", &S::a).field("b", &S::b).done();
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace dc::bindings {

template <typename S>
class ArgsClass {
 public:
  ArgsClass(pybind11::module_& m, const char* name, const char* doc)
      : cls_(m, name, doc), setters_(new Setters), name_(name) {}

  template <typename T>
  ArgsClass& field(const char* name, T S::*member) {
    cls_.def_readwrite(name, member);
    const std::string key = name, what = name_ + "." + name;
    names_.push_back(key);
    (*setters_)[key] = [member, what](S& s, pybind11::handle value) {
      try {
        s.*member = value.cast<T>();
      } catch (const pybind11::cast_error&) {
        const std::string type = pybind11::str(value.get_type().attr("__name__"));
        throw pybind11::type_error(what + ": cannot take a " + type);
      }
    };
    return *this;
  }

  // The keyword constructor, check() and FIELDS.
  void done() {
    auto setters = setters_;
    const auto names = names_;
    const std::string cls = name_;
    cls_.def(pybind11::init([setters, names, cls](const pybind11::kwargs& kw) {
      S s{};
      for (auto item : kw) {
        const std::string key = pybind11::str(item.first);
        const auto it = setters->find(key);
        if (it == setters->end()) throw pybind11::type_error(cls + ": unexpected field " + key);
        it->second(s, item.second);
      }
      if (kw.size() != names.size())
        for (const auto& n : names)
          if (!kw.contains(n.c_str())) throw pybind11::type_error(cls + ": missing field " + n);
      s.check();
      return s;
    }));
    cls_.def("check", &S::check, "Raise ValueError naming a field whose value is out of range.");
    pybind11::tuple fields(names.size());
    for (size_t i = 0; i < names.size(); ++i) fields[i] = pybind11::str(names[i]);
    cls_.attr("FIELDS") = fields;
  }

 private:
  using Setters = std::unordered_map<std::string, std::function<void(S&, pybind11::handle)>>;
  pybind11::class_<S> cls_;
  std::shared_ptr<Setters> setters_;
  std::vector<std::string> names_;
  std::string name_;
};

}  // namespace dc::bindings
