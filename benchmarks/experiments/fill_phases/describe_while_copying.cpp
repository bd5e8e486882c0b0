// Scratch (2026-11-28, dropped; see describe_while_copying_ab.py): bf16 -> fp32 fills that
// describe each source as they copy it, with no pass before the copy and no checks beyond dtype.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
namespace py = pybind11;

__attribute__((target("avx2"))) static void bf16_to_f32_stream(const uint16_t* s, float* d, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s + k)));
    _mm256_stream_ps(d + k, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  for (; k < n; ++k) { uint32_t b = uint32_t(s[k]) << 16; std::memcpy(d + k, &b, 4); }
}

void fill_lookahead(torch::Tensor buffer, py::tuple owners, std::vector<int64_t> offsets, int64_t grain, int64_t ahead) {
  const int64_t n = owners.size();
  float* base = buffer.data_ptr<float>();
  PyObject* tup = owners.ptr();
  {
    py::gil_scoped_release no_gil;
    at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      std::vector<const at::Tensor*> ring(e - b);
      auto describe = [&](int64_t i) {
        const at::Tensor& t = THPVariable_Unpack(PyTuple_GET_ITEM(tup, i));
        ring[i - b] = &t;
        const char* p = static_cast<const char*>(t.const_data_ptr());
        int64_t bytes = t.numel() * 2;
        for (int64_t o = 0; o < bytes; o += 4096) __builtin_prefetch(p + o);
        __builtin_prefetch(p + bytes - 1);
      };
      for (int64_t i = b; i < std::min(e, b + ahead); ++i) describe(i);
      for (int64_t i = b; i < e; ++i) {
        if (i + ahead < e) describe(i + ahead);
        const at::Tensor& t = *ring[i - b];
        TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous());
        bf16_to_f32_stream(static_cast<const uint16_t*>(t.const_data_ptr()), base + offsets[i], t.numel());
      }
      _mm_sfence();
    });
  }
}

void fill_pipelined(torch::Tensor buffer, py::tuple owners, std::vector<int64_t> offsets, int64_t grain) {
  const int64_t n = owners.size();
  float* base = buffer.data_ptr<float>();
  PyObject* tup = owners.ptr();
  {
    py::gil_scoped_release no_gil;
    at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const at::Tensor& t = THPVariable_Unpack(PyTuple_GET_ITEM(tup, i));
        TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous());
        bf16_to_f32_stream(static_cast<const uint16_t*>(t.const_data_ptr()), base + offsets[i], t.numel());
      }
      _mm_sfence();
    });
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fill_pipelined", &fill_pipelined); m.def("fill_lookahead", &fill_lookahead); }
