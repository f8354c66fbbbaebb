/* Three ways a connection dies, three statuses a C caller can tell apart:
 * a peer that goes silent (FERRY_ERR_PEER_TIMEOUT), one that sends
 * garbage (FERRY_ERR_PEER_MISBEHAVED), one that hangs up
 * (FERRY_ERR_DISCONNECTED). The peers are ferry's rogue test peers on
 * 127.0.0.1, their ports in FERRY_ROGUE_SILENT, FERRY_ROGUE_GARBAGE and
 * FERRY_ROGUE_HANGUP (set by capi/tests/c_program.rs). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

/* Writes to the rogue at port `$var` until the connection fails; returns
 * the status it failed with. */
static int fail_against(ferry_endpoint *ep, ferry_region *r, const char *var) {
    const char *port = getenv(var);
    CHECK(port != NULL);
    uint64_t conn = 0;
    CHECK(ferry_connect(ep, "127.0.0.1", (uint16_t)atoi(port), &conn) == FERRY_OK);
    /* A window the rogue never answers for: addr 0x1000, 64 bytes, rkey 1. */
    unsigned char w[FERRY_WINDOW_LEN] = {0};
    w[1] = 0x10;
    w[8] = 64;
    w[12] = 1;
    ferry_desc d = {r, 0, 64, w, FERRY_WINDOW_LEN, 0};
    time_t until = time(NULL) + 10;
    for (;;) {
        ferry_transfer *t = NULL;
        int s = ferry_post(ep, conn, FERRY_WRITE, &d, 1, NULL, 0, &t);
        if (s == FERRY_OK) {
            s = ferry_transfer_wait(t, 5000);
            ferry_transfer_release(t);
        }
        if (s != FERRY_OK) {
            /* Later calls on the dead connection say the same. */
            CHECK(ferry_post(ep, conn, FERRY_WRITE, &d, 1, NULL, 0, &t) == s);
            printf("%s: %d (%s)\n", var, s, ferry_last_error());
            return s;
        }
        CHECK(time(NULL) < until);
    }
}

int main(void) {
    ferry_config *cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_OP_TIMEOUT_MS", "500") == FERRY_OK);
    CHECK(ferry_config_set(cfg, "FERRY_TRANSPORT", "tcp") == FERRY_OK);
    ferry_endpoint *ep = NULL;
    CHECK(ferry_endpoint_create(cfg, &ep) == FERRY_OK);
    ferry_config_free(cfg);
    static unsigned char buf[64];
    ferry_region *r = NULL;
    CHECK(ferry_register(ep, buf, sizeof buf, 0, &r) == FERRY_OK);
    CHECK(fail_against(ep, r, "FERRY_ROGUE_SILENT") == FERRY_ERR_PEER_TIMEOUT);
    CHECK(fail_against(ep, r, "FERRY_ROGUE_GARBAGE") == FERRY_ERR_PEER_MISBEHAVED);
    CHECK(fail_against(ep, r, "FERRY_ROGUE_HANGUP") == FERRY_ERR_DISCONNECTED);
    CHECK(ferry_deregister(r) == FERRY_OK);
    ferry_endpoint_destroy(ep);
    printf("ferry C face: three causes, three statuses\n");
    return 0;
}
