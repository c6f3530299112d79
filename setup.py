"""Build of eagle_kernels: the Python package plus the native extension ``eagle_kernels._C``.

The extension (csrc/) is a CppExtension with the CPU kernels; when torch is a CUDA build and
nvcc is found (CUDA_HOME), it becomes a CUDAExtension that adds csrc/cuda/*.cu and
csrc/cuda/ops_cuda.cpp (EAGLE_WITH_CUDA). Nothing is downloaded during the build.

If the extension cannot be built (no torch at build time, no working C++ compiler, a compile
error), the pure-Python package is still installed and a message says why; the package then
falls back to its reference / Triton paths and warns at import.

Environment:
  TORCH_CUDA_ARCH_LIST        CUDA archs (e.g. "8.0;9.0"); default: the archs torch was built for
  EAGLE_KERNELS_NO_EXT=1      skip the native extension
  EAGLE_KERNELS_NO_CUDA=1     build the CPU extension only, even with CUDA available
  EAGLE_KERNELS_REQUIRE_EXT=1 fail the install when the extension does not build (CI)
  EAGLE_KERNELS_CXXFLAGS      extra host compiler flags, e.g. "-march=native" for a local build, "-g"
                              for debug information (built without it)
  MAX_JOBS                    parallel compile jobs (torch's ninja build)

Typical development install: ``pip install --no-build-isolation -e .``
"""

import glob
import os
import shlex
import subprocess
import sys
import tempfile

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _say(msg):
    print(f"[eagle_kernels setup] {msg}", file=sys.stderr, flush=True)


def _rel(pattern):
    # setuptools wants source paths relative to setup.py.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _compiler_accepts(flags):
    """True when the host C++ compiler compiles and links a trivial program with `flags`."""
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        cmd = [cxx, *flags, src, "-o", os.path.join(tmp, "probe")]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _nvcc_archs(cuda_home):
    """Virtual archs the local nvcc supports, e.g. {"8.0", "9.0", "9.0a"}; None if unknown."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    archs = {_arch_from_sm(a.replace("compute_", "sm_")) for a in out.split()}
    archs.discard(None)
    return archs or None


def _arch_from_sm(name):
    """"sm_90a" -> "9.0a", "sm_100" -> "10.0"; None if not an sm_/compute_ name."""
    if not name.startswith("sm_"):
        return None
    digits, suffix = name[3:], ""
    while digits and digits[-1].isalpha():
        digits, suffix = digits[:-1], digits[-1] + suffix
    if len(digits) < 2 or not digits.isdigit():
        return None
    return f"{digits[:-1]}.{digits[-1]}{suffix}"


def _torch_arch_list(torch, cuda_home):
    """TORCH_CUDA_ARCH_LIST-style string of the archs this torch was built for that the local
    nvcc can compile (newer nvcc drop old archs torch may still list)."""
    flags = ""
    try:
        flags = torch._C._cuda_getArchFlags() or ""  # e.g. "sm_80 sm_90 sm_100"
    except Exception:
        pass
    archs = [a for a in map(_arch_from_sm, flags.split()) if a is not None]
    supported = _nvcc_archs(cuda_home)
    if supported is not None:
        archs = [a for a in archs if a in supported]
    if not archs:
        archs = ["8.0", "9.0"]
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def _extension_and_cmdclass():
    if _env_flag("EAGLE_KERNELS_NO_EXT"):
        _say("EAGLE_KERNELS_NO_EXT is set: installing the pure-Python package only.")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # torch missing or broken in the build environment
        if _env_flag("EAGLE_KERNELS_REQUIRE_EXT"):
            raise
        _say(f"torch is not importable at build time ({exc!r}); skipping the native "
             "extension eagle_kernels._C. Use `pip install --no-build-isolation` with torch "
             "installed to build it.")
        return [], {}

    with_cuda = (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
                 and not _env_flag("EAGLE_KERNELS_NO_CUDA"))

    # -ffp-contract=off: a * b + c stays two roundings unless the code asks for an FMA, so the
    # unfused vector helpers (csrc/cpu/simd.h) give the portable loops' bits (verify's token
    # choices are identical across instruction sets); GCC's default contracts them in C++.
    # -g0: no debug information (Python's own CFLAGS carry -g): against torch's headers it made the
    # objects ~9-40x larger and the compiles about a quarter slower; EAGLE_KERNELS_CXXFLAGS="-g"
    # (appended below) puts it back.
    cxx_flags = ["-O3", "-g0", "-ffp-contract=off", "-DEAGLE_PYTHON_MODULE"]
    link_flags = []
    # at::parallel_for is header-inline OpenMP in torch builds; without -fopenmp it runs
    # serially. The libgomp torch ships has the same soname, so no second runtime is loaded.
    if _compiler_accepts(["-fopenmp"]):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    else:
        _say("the C++ compiler does not accept -fopenmp: CPU kernels will run single-threaded.")
    # No -march/-mavx512f by default: the kernels are memory-bound copies and integer
    # counting, and a wheel built with them would SIGILL on older x86_64 CPUs.
    cxx_flags += shlex.split(os.environ.get("EAGLE_KERNELS_CXXFLAGS", ""))

    # Largest first: ninja starts the compiles in this order, and verify.cpp (about a quarter of the
    # build's compile time at -O3) started second to last in name order, one core idle at the end.
    sources = sorted(_rel("csrc/cpu/*.cpp") + ["csrc/torch_bindings.cpp"],
                     key=lambda path: (-os.path.getsize(os.path.join(ROOT, path)), path))
    include_dirs = [os.path.join(ROOT, "csrc")]
    if with_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            # torch's default is the archs of the visible GPUs (none on a build box); build
            # for the archs torch itself supports instead.
            os.environ["TORCH_CUDA_ARCH_LIST"] = _torch_arch_list(torch, cpp_extension.CUDA_HOME)
        _say(f"building with CUDA ({cpp_extension.CUDA_HOME}), "
             f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
        sources += _rel("csrc/cuda/*.cu") + _rel("csrc/cuda/*.cpp")
        cxx_flags.append("-DEAGLE_WITH_CUDA")
        ext = cpp_extension.CUDAExtension(
            name="eagle_kernels._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags,
                                "nvcc": ["-O3", "-lineinfo", "-DEAGLE_WITH_CUDA"]},
            extra_link_args=link_flags,
        )
    else:
        _say("building the CPU extension (torch has no CUDA or nvcc was not found).")
        ext = cpp_extension.CppExtension(
            name="eagle_kernels._C",
            sources=sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExtensionOrSkip(base):
        """Builds eagle_kernels._C; on failure installs the pure-Python package instead."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # compiler missing, compile or link error
                if _env_flag("EAGLE_KERNELS_REQUIRE_EXT"):
                    raise
                _say("=" * 72)
                _say(f"building the native extension eagle_kernels._C FAILED: {exc}")
                _say("installing the pure-Python package only: eagle_kernels will use its "
                     "reference/Triton paths. Set EAGLE_KERNELS_REQUIRE_EXT=1 to make this an "
                     "error.")
                _say("=" * 72)
                self.extensions = []

        def get_outputs(self):
            # Editable/wheel builds copy these files; none exist after a skipped build.
            return super().get_outputs() if self.extensions else []

        def get_output_mapping(self):
            return super().get_output_mapping() if self.extensions else {}

    return [ext], {"build_ext": BuildExtensionOrSkip}


ext_modules, cmdclass = _extension_and_cmdclass()

setup(
    name="eagle_kernels",
    version=VERSION,
    license="Apache-2.0",
    description="Kernels for EAGLE-style speculative decoding (tree attention, draft "
                "expansion, tree building, verification, KV compaction).",
    packages=find_packages(include=["eagle_kernels*"]),
    # The trained SmolLM2-135M draft heads (fp16 safetensors + config + model card).
    package_data={"eagle_kernels.heads": ["*/config.json", "*/model.safetensors", "*/README.md", "*/training.json"]},
    python_requires=">=3.9",
    install_requires=["torch"],
    # Engine plugins (docs/serving.md); each stays inactive until the engine's plugin whitelist
    # names it (SGLANG_PLUGINS / VLLM_PLUGINS=eagle_kernels) or EAGLE_KERNELS_ENGINE_PLUGINS=1.
    entry_points={
        "sglang.srt.plugins": ["eagle_kernels = eagle_kernels.integrations.sglang:register"],
        "vllm.general_plugins": ["eagle_kernels = eagle_kernels.integrations.vllm:register"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
