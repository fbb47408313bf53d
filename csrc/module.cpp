// The megatron_lsgd._C extension: one register_* call per feature.
#include <pybind11/pybind11.h>

#include "quantize.h"

PYBIND11_MODULE(_C, m) {
    m.doc() = "megatron_lsgd C++ kernels";
    register_quantize_kernels(m);
}
