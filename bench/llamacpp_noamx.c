// Preloaded into the llama.cpp worker of bench/llamacpp.py (LD_PRELOAD): refuses the
// arch_prctl(ARCH_REQ_XCOMP_PERM) request through which ggml asks the kernel for the AMX tile
// state, so ggml reports "AMX is not ready" and keeps its other CPU paths (its AMX path crashed
// at the first decode of a Q8_0 / Q4_1 model on the Intel Xeon VM, see docs/benchmarks.md).
// Every other syscall() goes through unchanged.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023

long syscall(long number, ...) {
  va_list ap;
  va_start(ap, number);
  long a[6];
  for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
  va_end(ap);
  if (number == SYS_arch_prctl && a[0] == ARCH_REQ_XCOMP_PERM) {
    errno = EPERM;
    return -1;
  }
  static long (*real)(long, ...) = 0;
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
