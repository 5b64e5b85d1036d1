// The schemas of minisgl's CPU ops (each kernel's file registers its CPU implementation).
#include <torch/library.h>

TORCH_LIBRARY(minisgl, m) {
  m.def("int4_mm(Tensor x, Tensor q, Tensor sm) -> Tensor");
  m.def("decode_attn(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lens, float scale, int window=0, "
        "Tensor? sinks=None) -> Tensor");
}
