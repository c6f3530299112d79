// Every schema of torch.ops.eagle_kernels, and the native kernels registered for them.
//
// The schema strings are copied verbatim from eagle_kernels/_schemas.py (a test keeps the two
// identical). Native kernels: CPU (always) for every op of the schemas above; CUDA (EAGLE_WITH_CUDA builds)
// for build_tree and compact_kv. Every other (op, dispatch key) pair is left free for the
// Python side, which registers fakes and routes the remaining keys through backend_of.
#ifdef EAGLE_PYTHON_MODULE
#include <Python.h>  // first, as Python requires
#endif

#include <torch/library.h>

#include "cpu/simd.h"
#include "ops.h"

TORCH_LIBRARY(eagle_kernels, m) {
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
      "Tensor? tree_mask=None, *, Tensor? block_table=None, float? sm_scale=None) -> Tensor");
  m.def(
      "draft_expand(Tensor logits, Tensor frontier_scores, int top_k, *, Tensor? d2t=None, "
      "Tensor? temperature=None, Tensor? seed=None, Tensor? offset=None, int depth=0) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "build_tree(Tensor root_tokens, Tensor cand_tokens, Tensor cand_scores, "
      "Tensor cand_parents, int num_nodes) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "verify(Tensor tokens, Tensor parents, Tensor target_logits, *, int max_depth, "
      "Tensor? temperature=None, Tensor? top_k=None, Tensor? top_p=None, Tensor? seed=None, "
      "Tensor? offset=None, Tensor? draft_probs=None, Tensor? draft_sampled=None, Tensor? d2t=None, "
      "Tensor? positions=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "block_verify(Tensor tokens, Tensor target_logits, Tensor? draft_probs=None, *, Tensor? num_drafts=None, "
      "Tensor? temperature=None, Tensor? top_k=None, Tensor? top_p=None, Tensor? seed=None, Tensor? offset=None, "
      "Tensor? d2t=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("coupled_noise(Tensor seed, Tensor positions, int num_tokens, *, Tensor? d2t=None) -> Tensor");
  m.def(
      "coupled_draft_logits(Tensor logits, Tensor temperature, Tensor seed, Tensor positions, *, "
      "Tensor? d2t=None) -> Tensor");
  m.def(
      "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
      "Tensor accept_nodes, Tensor accept_len, *, Tensor? block_table=None) -> ()");
  m.def(
      "write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
      "Tensor cache_seqlens, *, Tensor? block_table=None) -> ()");
  m.def("cpu_linear(Tensor x, Tensor weight) -> Tensor");
  m.def(
      "cpu_decoder_layer(Tensor x, Tensor input_norm, Tensor qkv_weight, Tensor o_weight, "
      "Tensor post_norm, Tensor gate_up_weight, Tensor down_weight, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask=None, *, "
      "int num_heads, float eps, Tensor? embed=None, Tensor? embed_norm=None, int slot_offset=0, "
      "Tensor? row_counts=None) -> Tensor");
  m.def(
      "cpu_decoder_layers(Tensor x, Tensor[] input_norm, Tensor[] qkv_weight, Tensor[] o_weight, "
      "Tensor[] post_norm, Tensor[] gate_up_weight, Tensor[] down_weight, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask=None, *, "
      "int num_heads, float eps, int[] state_layers=[], Tensor? row_counts=None) -> (Tensor, Tensor)");
  m.def(
      "cpu_decoder_forward(Tensor tokens, Tensor embed_table, Tensor rope_cos, Tensor rope_sin, Tensor? positions, "
      "Tensor[] input_norm, Tensor[] qkv_weight, Tensor[] o_weight, Tensor[] post_norm, Tensor[] gate_up_weight, "
      "Tensor[] down_weight, Tensor final_norm, Tensor lm_head, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_seqlens, Tensor? tree_mask=None, *, int num_heads, float eps, int[] state_layers=[], "
      "Tensor? row_counts=None, Tensor? logit_rows=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "cpu_head_forward(Tensor tokens, Tensor embed_table, Tensor features, Tensor? fc_weight, Tensor rope_cos, "
      "Tensor rope_sin, Tensor positions, Tensor input_norm, Tensor embed_norm, Tensor qkv_weight, Tensor o_weight, "
      "Tensor post_norm, Tensor gate_up_weight, Tensor down_weight, Tensor? final_norm, Tensor? lm_head, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? tree_mask=None, *, int num_heads, "
      "float eps, int slot_offset=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(eagle_kernels, CPU, m) {
  m.impl("tree_attention", &eagle::tree_attention_cpu);
  m.impl("draft_expand", &eagle::draft_expand_cpu);
  m.impl("build_tree", &eagle::build_tree_cpu);
  m.impl("compact_kv", &eagle::compact_kv_cpu);
  m.impl("write_kv", &eagle::write_kv_cpu);
  m.impl("verify", &eagle::verify_cpu);
  m.impl("block_verify", &eagle::block_verify_cpu);
  m.impl("coupled_noise", &eagle::coupled_noise_cpu);
  m.impl("coupled_draft_logits", &eagle::coupled_draft_logits_cpu);
  m.impl("cpu_linear", &eagle::cpu_linear_cpu);
  m.impl("cpu_decoder_layer", &eagle::cpu_decoder_layer_cpu);
  m.impl("cpu_decoder_layers", &eagle::cpu_decoder_layers_cpu);
  m.impl("cpu_decoder_forward", &eagle::cpu_decoder_forward_cpu);
  m.impl("cpu_head_forward", &eagle::cpu_head_forward_cpu);
}

#ifdef EAGLE_WITH_CUDA
TORCH_LIBRARY_IMPL(eagle_kernels, CUDA, m) {
  m.impl("build_tree", &eagle::build_tree_cuda);
  m.impl("compact_kv", &eagle::compact_kv_cuda);
}
#endif

#ifdef EAGLE_PYTHON_MODULE
// `import eagle_kernels._C` loads this library, which runs the registrations above. The module
// itself only says whether CUDA was built (WITH_CUDA) and which CPU instruction set the kernels
// run at now (cpu_isa(), csrc/cpu/simd.h); which ops have native kernels is the dispatcher's
// answer, so it is not listed a second time here:
//   torch._C._dispatch_has_kernel_for_dispatch_key("eagle_kernels::<op>", "CPU")
static PyObject* cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(eagle::isa::level_name(eagle::isa::current()));
  } catch (const c10::Error& e) {  // an EAGLE_KERNELS_CPU_ISA outside the vocabulary
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

static PyMethodDef eagle_c_methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "The CPU instruction-set level the kernels run at now: scalar, avx2, avx512-ymm, avx512 or avx512-bf16."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef eagle_c_module = {
    PyModuleDef_HEAD_INIT,
    "eagle_kernels._C",
    "Native kernels of eagle_kernels (registered under torch.ops.eagle_kernels on import).",
    -1,
    eagle_c_methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&eagle_c_module);
  if (m == nullptr) return nullptr;
#ifdef EAGLE_WITH_CUDA
  PyObject* with_cuda = Py_True;
#else
  PyObject* with_cuda = Py_False;
#endif
  Py_INCREF(with_cuda);
  if (PyModule_AddObject(m, "WITH_CUDA", with_cuda) < 0) {
    Py_DECREF(with_cuda);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
#endif
