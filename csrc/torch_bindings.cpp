// Every schema of torch.ops.eagle_kernels, and the native kernels registered for them.
//
// The schema strings are copied verbatim from eagle_kernels/_schemas.py (a test keeps the two
// identical). Native kernels: CPU (always) for build_tree, compact_kv and verify; CUDA
// (EAGLE_WITH_CUDA builds) for build_tree and compact_kv. Every other (op, dispatch key) pair
// is left free for the Python side, which registers fakes and routes the remaining keys
// through backend_of.
#ifdef EAGLE_PYTHON_MODULE
#include <Python.h>  // first, as Python requires
#endif

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(eagle_kernels, m) {
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
      "Tensor? tree_mask=None, *, Tensor? block_table=None, float? sm_scale=None) -> Tensor");
  m.def(
      "draft_expand(Tensor logits, Tensor frontier_scores, int top_k, *, Tensor? d2t=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "build_tree(Tensor root_tokens, Tensor cand_tokens, Tensor cand_scores, "
      "Tensor cand_parents, int num_nodes) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "verify(Tensor tokens, Tensor parents, Tensor target_logits, *, int max_depth, "
      "Tensor? temperature=None, Tensor? top_k=None, Tensor? top_p=None, Tensor? seed=None, "
      "Tensor? offset=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
      "Tensor accept_nodes, Tensor accept_len, *, Tensor? block_table=None) -> ()");
}

TORCH_LIBRARY_IMPL(eagle_kernels, CPU, m) {
  m.impl("build_tree", &eagle::build_tree_cpu);
  m.impl("compact_kv", &eagle::compact_kv_cpu);
  m.impl("verify", &eagle::verify_cpu);
}

#ifdef EAGLE_WITH_CUDA
TORCH_LIBRARY_IMPL(eagle_kernels, CUDA, m) {
  m.impl("build_tree", &eagle::build_tree_cuda);
  m.impl("compact_kv", &eagle::compact_kv_cuda);
}
#endif

#ifdef EAGLE_PYTHON_MODULE
// `import eagle_kernels._C` loads this library, which runs the registrations above. The module
// itself only says what was built: WITH_CUDA, and NATIVE_KERNELS = {dispatch key: op names}.
// The authoritative question stays the dispatcher's:
//   torch._C._dispatch_has_kernel_for_dispatch_key("eagle_kernels::<op>", "CPU")
static PyObject* native_kernels() {
  PyObject* cpu = Py_BuildValue("(sss)", "build_tree", "compact_kv", "verify");
#ifdef EAGLE_WITH_CUDA
  PyObject* cuda = Py_BuildValue("(ss)", "build_tree", "compact_kv");
#else
  PyObject* cuda = PyTuple_New(0);
#endif
  if (cpu == nullptr || cuda == nullptr) {
    Py_XDECREF(cpu);
    Py_XDECREF(cuda);
    return nullptr;
  }
  PyObject* d = Py_BuildValue("{sNsN}", "CPU", cpu, "CUDA", cuda);  // N steals the references
  return d;
}

static struct PyModuleDef eagle_c_module = {
    PyModuleDef_HEAD_INIT, "eagle_kernels._C",
    "Native kernels of eagle_kernels (registered under torch.ops.eagle_kernels on import).",
    -1, nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&eagle_c_module);
  if (m == nullptr) return nullptr;
#ifdef EAGLE_WITH_CUDA
  PyObject* with_cuda = Py_True;
#else
  PyObject* with_cuda = Py_False;
#endif
  Py_INCREF(with_cuda);
  PyObject* kernels = native_kernels();
  if (kernels == nullptr || PyModule_AddObject(m, "WITH_CUDA", with_cuda) < 0 ||
      PyModule_AddObject(m, "NATIVE_KERNELS", kernels) < 0) {
    Py_XDECREF(kernels);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
#endif
