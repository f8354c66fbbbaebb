/* What the C test programs share: CHECK (print the failed condition and
 * ferry's last error, exit 1) and whole reads and writes on a pipe. */
#ifndef FERRY_TEST_CHECK_H
#define FERRY_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ferry.h"

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: %s failed (last error: %s)\n", __FILE__, \
                    __LINE__, #cond, ferry_last_error());                    \
            exit(1);                                                         \
        }                                                                    \
    } while (0)

static inline void put_all(int fd, const void *p, size_t n) { CHECK(write(fd, p, n) == (ssize_t)n); }

static inline void get_all(int fd, void *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        CHECK(r > 0);
        got += (size_t)r;
    }
}

#endif
