// Index builders for the GPT and blended datasets (see megatron_lsgd/core/datasets/helpers.py
// for the pure-Python reference these must match exactly).
#pragma once

#include <pybind11/pybind11.h>

void register_dataset_helpers(pybind11::module_& m);
