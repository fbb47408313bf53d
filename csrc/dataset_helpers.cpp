// Sample-index and blending-index builders. Both are sequential scans that are slow in
// Python for large corpora (one iteration per document or per sample), hence C++.
// Every array access is bounds-checked against its input so a bad index raises instead
// of reading out of bounds.
#include "dataset_helpers.h"

#include <pybind11/numpy.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using SizesArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using DocIdxArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using WeightsArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Sample i covers the token stream from (doc_idx position, offset) sample_idx[i] to
// sample_idx[i+1] inclusive: seq_length + 1 tokens, so consecutive samples share one token
// (the last label of sample i is the first input of sample i+1).
py::array_t<int64_t> build_sample_idx(const SizesArray& sizes, const DocIdxArray& doc_idx,
                                      int64_t seq_length, int64_t num_samples) {
    if (seq_length < 1) throw py::value_error("build_sample_idx: seq_length must be >= 1");
    if (num_samples < 0) throw py::value_error("build_sample_idx: num_samples must be >= 0");
    if (sizes.ndim() != 1 || doc_idx.ndim() != 1)
        throw py::value_error("build_sample_idx: sizes and doc_idx must be 1-D");

    const int32_t* sz = sizes.data();
    const int64_t* di = doc_idx.data();
    const int64_t n_sizes = sizes.shape(0);
    const int64_t n_docs = doc_idx.shape(0);

    py::array_t<int64_t> out({num_samples + 1, int64_t{2}});
    int64_t* o = out.mutable_data();
    std::string error;
    {
        py::gil_scoped_release release;
        int64_t doc_pos = 0;  // position in doc_idx
        int64_t offset = 0;   // token offset inside the current document
        o[0] = 0;
        o[1] = 0;
        for (int64_t s = 1; s <= num_samples && error.empty(); ++s) {
            int64_t remaining = seq_length + 1;
            while (remaining != 0) {
                if (doc_pos >= n_docs) {
                    error = "build_sample_idx: document index exhausted after " + std::to_string(s - 1) +
                            " samples; not enough tokens for " + std::to_string(num_samples) + " samples";
                    break;
                }
                const int64_t doc = di[doc_pos];
                if (doc < 0 || doc >= n_sizes) {
                    error = "build_sample_idx: doc_idx[" + std::to_string(doc_pos) + "] = " + std::to_string(doc) +
                            " is outside [0, " + std::to_string(n_sizes) + ")";
                    break;
                }
                const int64_t doc_len = static_cast<int64_t>(sz[doc]) - offset;
                remaining -= doc_len;
                if (remaining <= 0) {
                    // The sample ends inside this document; step back one token so the next
                    // sample starts at this sample's last token.
                    offset += remaining + doc_len - 1;
                    remaining = 0;
                } else {
                    ++doc_pos;
                    offset = 0;
                }
            }
            o[2 * s] = doc_pos;
            o[2 * s + 1] = offset;
        }
    }
    if (!error.empty()) throw py::value_error(error);
    return out;
}

// Greedy apportionment: sample i goes to the dataset whose count lags its target share
// weight * (i + 1) the most, so every prefix of the blend tracks the weights within one sample.
py::tuple build_blending_indices(const WeightsArray& weights, int64_t size) {
    if (weights.ndim() != 1 || weights.shape(0) < 1)
        throw py::value_error("build_blending_indices: weights must be a non-empty 1-D array");
    if (size < 0) throw py::value_error("build_blending_indices: size must be >= 0");
    const int64_t n = weights.shape(0);
    const double* w = weights.data();
    for (int64_t d = 0; d < n; ++d)
        if (!(w[d] >= 0.0)) throw py::value_error("build_blending_indices: weights must be >= 0");

    py::array_t<int32_t> dataset_index(size);
    py::array_t<int64_t> dataset_sample_index(size);
    int32_t* di = dataset_index.mutable_data();
    int64_t* dsi = dataset_sample_index.mutable_data();
    {
        py::gil_scoped_release release;
        std::vector<int64_t> counts(static_cast<size_t>(n), 0);
        for (int64_t i = 0; i < size; ++i) {
            const double target = static_cast<double>(i + 1);
            int64_t best = 0;
            double best_err = w[0] * target - static_cast<double>(counts[0]);
            for (int64_t d = 1; d < n; ++d) {
                const double err = w[d] * target - static_cast<double>(counts[d]);
                if (err > best_err) {
                    best_err = err;
                    best = d;
                }
            }
            di[i] = static_cast<int32_t>(best);
            dsi[i] = counts[best]++;
        }
    }
    return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

void register_dataset_helpers(py::module_& m) {
    m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
          py::arg("num_samples"),
          "Sample index [num_samples + 1, 2] of (doc_idx position, token offset) for GPT samples.");
    m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
          "(dataset_index int32[size], dataset_sample_index int64[size]) for a weighted blend.");
}
