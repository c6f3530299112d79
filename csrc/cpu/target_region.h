// Target regions: every function defined between EAGLE_TARGET_PUSH("isa,...") and
// EAGLE_TARGET_POP, templates included, is compiled for those instruction sets, so one source
// (an .inc file included once per region) yields one variant per instruction set; callers pick
// a variant at run time (__builtin_cpu_supports). The extension itself targets plain x86-64.
#pragma once

#define EAGLE_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define EAGLE_TARGET_PUSH(isa) EAGLE_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define EAGLE_TARGET_POP EAGLE_PRAGMA(clang attribute pop)
#else
#define EAGLE_TARGET_PUSH(isa) EAGLE_PRAGMA(GCC push_options) EAGLE_PRAGMA(GCC target(isa))
#define EAGLE_TARGET_POP EAGLE_PRAGMA(GCC pop_options)
#endif
