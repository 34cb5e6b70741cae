// One C ABI call's parameter list (detops_aot.h), built up as a host framework passes it: raw
// buffers, their shapes and dtype names. Shared by the C ABI tests and the sanitizer driver.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace detops_test {

using AotFn = int (*)(int, void**, int*, int64_t**, const char**, void*, void*);

struct AotCallList {
  std::vector<void*> params;
  std::vector<int> ndims;
  std::vector<std::vector<int64_t>> shape_store;
  std::vector<int64_t*> shapes;
  std::vector<const char*> dtypes;

  void add(void* data, std::vector<int64_t> shape, const char* dtype) {
    params.push_back(data);
    ndims.push_back(static_cast<int>(shape.size()));
    shape_store.push_back(std::move(shape));
    dtypes.push_back(dtype);
  }
  // Calls fn with the list; nparam >= 0 passes that count instead of the list's length. A
  // parameter of no dimensions gets a NULL shape, which the ABI never reads.
  int operator()(AotFn fn, int nparam = -1) {
    shapes.clear();
    for (auto& s : shape_store) shapes.push_back(s.empty() ? nullptr : s.data());
    return fn(nparam >= 0 ? nparam : static_cast<int>(params.size()), params.data(), ndims.data(),
              shapes.data(), dtypes.data(), nullptr, nullptr);
  }
};

}  // namespace detops_test
