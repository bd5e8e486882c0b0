// Direct Python bindings of the fused ops' CPU hot path (see fast_path.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace zero_lifetime::ops {

void add_fast_path_bindings(pybind11::module& m);

}  // namespace zero_lifetime::ops
