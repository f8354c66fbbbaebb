/* What benches/loopback_cost.c and benches/tcp_pipeline.c share: a
 * connected loopback TCP pair, both ends non-blocking with TCP_NODELAY.
 * Include after <arpa/inet.h>, <fcntl.h>, <netinet/in.h>, <netinet/tcp.h>,
 * <stdio.h>, <stdlib.h>, <sys/socket.h> and <unistd.h>. */
#ifndef FERRY_BENCHES_LOOPBACK_PAIR_H
#define FERRY_BENCHES_LOOPBACK_PAIR_H

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void tcp_pair(int *a, int *b) {
    struct sockaddr_in s = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof s;
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (l < 0 || bind(l, (void *)&s, sizeof s) || listen(l, 1) || getsockname(l, (void *)&s, &n))
        die("listen");
    *a = socket(AF_INET, SOCK_STREAM, 0);
    if (*a < 0 || connect(*a, (void *)&s, sizeof s)) die("connect");
    if ((*b = accept(l, 0, 0)) < 0) die("accept");
    close(l);
    for (int i = 0; i < 2; i++) {
        int fd = i ? *b : *a;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fcntl(fd, F_SETFL, O_NONBLOCK);
    }
}

#endif
