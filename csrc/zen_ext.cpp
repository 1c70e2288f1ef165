// Op schemas of the zen_ext library; kernels live in csrc/cpu and csrc/cuda (one file per device).
#include <Python.h>
#include <torch/library.h>

// An empty Python module: importing zen_ext._C runs the static registrars below and in the kernels.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}

TORCH_LIBRARY(zen_ext, m) {
  // P(idx) or its inverse: the keyed permutation of [0, numel) behind h0.
  m.def("permute(Tensor idx, int numel, Tensor keys, bool inverse) -> Tensor");
  // Group indices by partition P(idx) % num_parts. Returns (counts, order, pos, stats) where stats =
  // [collisions, serial writes, serial-memory overflows] (Algorithm 1 counters; zeros on the CPU).
  m.def(
      "hash_partition(Tensor idx, int numel, int num_parts, Tensor keys, int num_rehash=3, "
      "float parallel_factor=2.0, float serial_factor=0.1) -> (Tensor, Tensor, Tensor, Tensor)");
}
