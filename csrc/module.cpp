// The megatron_lsgd._C extension: one registration call per group of kernels.
#include <pybind11/pybind11.h>

#include "dataset_helpers.h"

PYBIND11_MODULE(_C, m) {
    m.doc() = "megatron_lsgd native helpers";
    register_dataset_helpers(m);
}
