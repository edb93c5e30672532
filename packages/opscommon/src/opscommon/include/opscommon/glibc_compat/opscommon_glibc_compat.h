// Forced into every C++ and CUDA translation unit by opscommon.build
// (-include), so that functions whose default symbol version moved after
// glibc 2.28 bind to their glibc 2.2.5 versions instead:
// - libm's exp, log, pow, exp2, log2 (GLIBC_2.29: the same code, with the
//   classic errno handling);
// - the dl* functions (GLIBC_2.34, when libdl moved into libc): torch >= 2.14's
//   stable headers look symbols up with dlsym. The 2.2.5 version is libdl's
//   on glibc < 2.34 (torch's own libraries load libdl first) and a
//   compatibility symbol of libc on newer glibc.
// Without this a binary built on a newer glibc needs GLIBC_2.29 / 2.34 and
// does not load on glibc 2.28 systems. The old versions are each CPU's first
// glibc symbol versions: GLIBC_2.2.5 on x86_64, GLIBC_2.17 on aarch64.
// tools/ checks every built binary's symbol versions against the floor.
#pragma once

#if defined(__linux__) && __has_include(<features.h>)
#include <features.h>  // defines __GLIBC__
#endif

#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__CUDA_ARCH__)
__asm__(".symver exp,exp@GLIBC_2.2.5");
__asm__(".symver log,log@GLIBC_2.2.5");
__asm__(".symver pow,pow@GLIBC_2.2.5");
__asm__(".symver exp2,exp2@GLIBC_2.2.5");
__asm__(".symver log2,log2@GLIBC_2.2.5");
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver dlclose,dlclose@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");
__asm__(".symver dladdr,dladdr@GLIBC_2.2.5");
#elif defined(__aarch64__) && defined(__GLIBC__) && !defined(__CUDA_ARCH__)
__asm__(".symver exp,exp@GLIBC_2.17");
__asm__(".symver log,log@GLIBC_2.17");
__asm__(".symver pow,pow@GLIBC_2.17");
__asm__(".symver exp2,exp2@GLIBC_2.17");
__asm__(".symver log2,log2@GLIBC_2.17");
__asm__(".symver dlopen,dlopen@GLIBC_2.17");
__asm__(".symver dlsym,dlsym@GLIBC_2.17");
__asm__(".symver dlclose,dlclose@GLIBC_2.17");
__asm__(".symver dlerror,dlerror@GLIBC_2.17");
__asm__(".symver dladdr,dladdr@GLIBC_2.17");
#endif
