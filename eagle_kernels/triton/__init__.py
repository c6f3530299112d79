"""Triton kernels (GPU path; CPU tensors under TRITON_INTERPRET=1). One module per op, named
after it, exporting a launcher with the op's contract signature (verify's kernels live in
verify_rows.py and verify_walk.py beside it). Each launcher takes its tuning constants from a
configuration object, GPU_CONFIG or INTERPRETER_CONFIG, chosen per launch (_launch_config.py)."""
