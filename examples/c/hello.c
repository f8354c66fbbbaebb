/* ferry from C, the shortest way: two endpoints in one process, one WRITE
 * with a notification attached, checked on the other side.
 *
 *   cargo build --release -p ferry-capi
 *   cc -I include examples/c/hello.c -L target/release -lferry \
 *      -Wl,-rpath,$PWD/target/release -o hello && ./hello
 */
#include <stdio.h>
#include <string.h>

#include "ferry.h"

#define TRY(call)                                                        \
    do {                                                                 \
        int32_t s_ = (call);                                             \
        if (s_ != FERRY_OK) {                                            \
            fprintf(stderr, "%s: %d: %s\n", #call, s_, ferry_last_error()); \
            return 1;                                                    \
        }                                                                \
    } while (0)

int main(void) {
    ferry_endpoint *target = NULL, *initiator = NULL;
    TRY(ferry_endpoint_create(NULL, &target));
    TRY(ferry_endpoint_create(NULL, &initiator));
    TRY(ferry_start_passive_accept(target));

    /* The initiator connects with the target's metadata. */
    unsigned char meta[512];
    size_t meta_len = 0;
    TRY(ferry_endpoint_metadata(target, meta, sizeof meta, &meta_len));
    uint64_t conn = 0, back = 0;
    TRY(ferry_add_remote(initiator, meta, meta_len, &conn));
    TRY(ferry_accept(target, 5000, &back));

    /* The target registers a buffer and advertises a window on it. */
    static char inbox[64], outbox[64] = "hello from C";
    ferry_region *in = NULL, *out = NULL;
    TRY(ferry_register(target, inbox, sizeof inbox, 0, &in));
    unsigned char window[FERRY_WINDOW_LEN];
    TRY(ferry_advertise(target, back, in, 0, sizeof inbox, window, sizeof window));

    /* The initiator WRITEs into it; the notification follows the bytes. */
    TRY(ferry_register(initiator, outbox, sizeof outbox, 0, &out));
    ferry_desc d = {out, 0, sizeof outbox, window, sizeof window, 0};
    ferry_transfer *t = NULL;
    TRY(ferry_post(initiator, conn, FERRY_WRITE, &d, 1, (const uint8_t *)"sent", 4, &t));
    TRY(ferry_transfer_wait(t, 5000));
    ferry_transfer_release(t);

    unsigned char note[FERRY_MAX_NOTIFY];
    size_t note_len = 0;
    uint64_t from = 0;
    TRY(ferry_recv_notification(target, 5000, &from, note, sizeof note, &note_len));
    printf("notification \"%.*s\"; the target holds \"%s\"\n", (int)note_len, note, inbox);

    TRY(ferry_deregister(out));
    TRY(ferry_deregister(in));
    ferry_endpoint_destroy(initiator);
    ferry_endpoint_destroy(target);
    return strcmp(inbox, outbox) == 0 ? 0 : 1;
}
