// Forced into every C++ translation unit by opscommon.build (-include), so
// that the libm functions whose default version moved after glibc 2.28 bind
// to their glibc 2.2.5 versions instead (the same code, with the classic
// errno handling). Without this, a call of `exp` built on glibc >= 2.29
// needs GLIBC_2.29 and the binary does not load on glibc 2.28 systems.
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
#endif
