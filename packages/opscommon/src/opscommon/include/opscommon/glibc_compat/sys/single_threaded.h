// Stand-in for glibc 2.32's <sys/single_threaded.h>, found before the
// system's because opscommon.build puts this folder on the include path.
//
// libstdc++ (GCC >= 11) reads `__libc_single_threaded` to skip atomic
// reference counting when a process has one thread. Built against glibc >=
// 2.32 that reference alone makes the binary need GLIBC_2.32, so it cannot
// load on glibc 2.28 (RHEL/Rocky 8, the manylinux_2_28 floor torch's own
// wheels promise). Here the flag reads as "never single-threaded": libstdc++
// always uses the atomic path, which is what it does on glibc < 2.32 and is
// correct with any number of threads.
#pragma once

#ifdef __cplusplus
extern "C++" {
#endif
inline constexpr char opscommon_libc_single_threaded = 0;
#ifdef __cplusplus
}
#endif
#define __libc_single_threaded opscommon_libc_single_threaded
