/* LD_PRELOAD helper for crashes in native extensions on machines without gdb: on SIGSEGV/SIGABRT/SIGBUS
 * it prints the native backtrace (frames as module(+offset), which `addr2line -f -C -e MODULE OFFSET`
 * turns into functions and lines) and the loaded-module map, then re-raises the signal.
 *   gcc -shared -fPIC -O1 -o /tmp/segv_trace.so scripts/segv_trace.c
 *   LD_PRELOAD=/tmp/segv_trace.so python3 ...                                                    */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    const char head[] = "\n=== segv_trace: native backtrace ===\n";
    write(2, head, sizeof(head) - 1);
    backtrace_symbols_fd(frames, n, 2);
    const char maps[] = "=== /proc/self/maps (executable) ===\n";
    write(2, maps, sizeof(maps) - 1);
    int fd = open("/proc/self/maps", O_RDONLY);
    char buf[4096];
    ssize_t got;
    while (fd >= 0 && (got = read(fd, buf, sizeof(buf))) > 0) write(2, buf, (size_t)got);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fault;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
    sigaction(SIGABRT, &sa, NULL);
}
