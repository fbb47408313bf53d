// The megatron_lsgd._C extension: one register_* call per group of kernels.
#include <pybind11/pybind11.h>

#include "dataset_helpers.h"
#include "quantize.h"

PYBIND11_MODULE(_C, m) {
    m.doc() = "megatron_lsgd C++ kernels: dataset index builders, int4/int8 quantization";
    register_dataset_helpers(m);
    register_quantize_kernels(m);
}
