"""gpu_model.py goals with bench_verify's rows unspiked (SPIKE 0: top-p 0.9 nuclei of 800-1200 entries)."""
import runpy
import sys

sys.path.insert(0, "bench")
import bench_verify  # noqa: E402

bench_verify.SPIKE = 0.0
sys.argv = ["bench/gpu_model.py", *sys.argv[1:]]
runpy.run_path("bench/gpu_model.py", run_name="__main__")
