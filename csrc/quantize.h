// Symmetric per-block absmax quantization to int8 / packed int4 (pybind11 kernels).
#pragma once

#include <pybind11/pybind11.h>

void register_quantize_kernels(pybind11::module_& m);
