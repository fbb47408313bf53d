// int8 / int4 quantize + pack and unpack + dequantize, threaded over blocks.
//
// Must agree bit for bit with the torch fallback in megatron_lsgd/core/lsgd/quantization.py:
//   scale = absmax(block) / qmax            (float32)
//   q     = clamp(nearbyint(x / scale), -qmax, qmax)  (x / 1 when scale == 0)
//   int4 is stored as q + 8 in a nibble, element 2i in the low nibble of byte i.
// nearbyint uses the default round-half-to-even mode, like torch.round.
#include "quantize.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

template <typename Fn>
void parallel_blocks(int64_t num_blocks, int num_threads, Fn fn) {
    // Small inputs are not worth a thread start (~tens of microseconds).
    int64_t max_useful = std::max<int64_t>(1, num_blocks / 256);
    int threads = static_cast<int>(std::min<int64_t>(std::max(1, num_threads), max_useful));
    if (threads <= 1) {
        fn(0, num_blocks);
        return;
    }
    std::vector<std::thread> pool;
    int64_t per = (num_blocks + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
        int64_t lo = t * per, hi = std::min(num_blocks, lo + per);
        if (lo >= hi) break;
        pool.emplace_back([=] { fn(lo, hi); });
    }
    for (auto& th : pool) th.join();
}

inline float block_scale(const float* x, int64_t n, float qmax) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    return absmax / qmax;
}

inline int quantize_one(float x, float scale, float qmax) {
    float divisor = scale == 0.0f ? 1.0f : scale;
    float q = std::nearbyint(x / divisor);
    q = std::min(qmax, std::max(-qmax, q));
    return static_cast<int>(q);
}

// bits 8: out has n bytes (int8); bits 4: out has ceil(n/2) bytes (nibbles).
py::tuple quantize(py::array_t<float, py::array::c_style | py::array::forcecast> x, int bits, int64_t block,
                   int num_threads) {
    if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
    if (block < 2 || block % 2) throw std::invalid_argument("block must be even and >= 2");
    const int64_t n = x.size();
    const int64_t num_blocks = (n + block - 1) / block;
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    py::array_t<uint8_t> packed(bits == 8 ? n : (n + 1) / 2);
    py::array_t<float> scales(num_blocks);
    const float* src = x.data();
    uint8_t* dst = packed.mutable_data();
    float* sc = scales.mutable_data();
    {
        py::gil_scoped_release release;
        parallel_blocks(num_blocks, num_threads, [&](int64_t b0, int64_t b1) {
            for (int64_t b = b0; b < b1; ++b) {
                const int64_t lo = b * block, hi = std::min(n, lo + block);
                const float scale = block_scale(src + lo, hi - lo, qmax);
                sc[b] = scale;
                if (bits == 8) {
                    for (int64_t i = lo; i < hi; ++i)
                        dst[i] = static_cast<uint8_t>(static_cast<int8_t>(quantize_one(src[i], scale, qmax)));
                } else {
                    // Blocks are even-sized, so a byte never straddles two blocks.
                    for (int64_t i = lo; i < hi; i += 2) {
                        int q0 = quantize_one(src[i], scale, qmax) + 8;
                        int q1 = i + 1 < hi ? quantize_one(src[i + 1], scale, qmax) + 8 : 0;
                        dst[i / 2] = static_cast<uint8_t>(q0 | (q1 << 4));
                    }
                }
            }
        });
    }
    return py::make_tuple(packed, scales);
}

py::array_t<float> dequantize(py::array_t<uint8_t, py::array::c_style | py::array::forcecast> packed,
                              py::array_t<float, py::array::c_style | py::array::forcecast> scales, int bits,
                              int64_t n, int64_t block, int num_threads) {
    if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
    if (block < 2 || block % 2) throw std::invalid_argument("block must be even and >= 2");
    const int64_t num_blocks = (n + block - 1) / block;
    if (scales.size() != num_blocks) throw std::invalid_argument("scales do not match n / block");
    if (packed.size() != (bits == 8 ? n : (n + 1) / 2)) throw std::invalid_argument("packed size does not match n");
    py::array_t<float> out(n);
    const uint8_t* src = packed.data();
    const float* sc = scales.data();
    float* dst = out.mutable_data();
    {
        py::gil_scoped_release release;
        parallel_blocks(num_blocks, num_threads, [&](int64_t b0, int64_t b1) {
            for (int64_t b = b0; b < b1; ++b) {
                const int64_t lo = b * block, hi = std::min(n, lo + block);
                const float scale = sc[b];
                for (int64_t i = lo; i < hi; ++i) {
                    int q = bits == 8 ? static_cast<int>(static_cast<int8_t>(src[i]))
                                      : static_cast<int>((src[i / 2] >> (4 * (i & 1))) & 0xF) - 8;
                    dst[i] = static_cast<float>(q) * scale;
                }
            }
        });
    }
    return out;
}

}  // namespace

void register_quantize_kernels(py::module_& m) {
    m.def("quantize_blockwise", &quantize, py::arg("x"), py::arg("bits"), py::arg("block"),
          py::arg("num_threads") = 1,
          "Symmetric per-block absmax quantization; returns (packed uint8, float32 scales).");
    m.def("dequantize_blockwise", &dequantize, py::arg("packed"), py::arg("scales"), py::arg("bits"), py::arg("n"),
          py::arg("block"), py::arg("num_threads") = 1, "Inverse of quantize_blockwise (float32 values).");
}
