"""Triton kernels (GPU path; CPU tensors under TRITON_INTERPRET=1). One module per op, named
after it, exporting a launcher with the op's contract signature."""
