//! The runner's kernel, in PTX: what the driver JIT-compiles at load.

/// The runner, in PTX (ISA 7.0, sm_70 and later), NUL-terminated.
/// `ferry_runner(ctl, last, idle_ns, life_ns)`: `last` is the `seq` it
/// starts from (a different one at `ctl` is a copy waiting).
pub(crate) const PTX: &str = concat!(
    r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry ferry_runner(
    .param .u64 ctl,
    .param .u32 last,
    .param .u64 idle_ns,
    .param .u64 life_ns
)
{
    .reg .pred %p<8>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<32>;
    .shared .align 16 .b64 job[3];

    ld.param.u64 %rd1, [ctl];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r2, [last];
    ld.param.u64 %rd20, [idle_ns];
    ld.param.u64 %rd23, [life_ns];
    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p1, %r1, 0;
    mov.u64 %rd21, %globaltimer;
    add.s64 %rd23, %rd23, %rd21;
LOOP:
    @%p1 bra WAIT;
POLL:
    // Thread 0 polls the word, with the descriptor read in the same
    // round trip (its loads are issued before the word's acquire load,
    // not after it); GOT checks the descriptor's tags.
    ld.volatile.global.v2.u64 {%rd4, %rd5}, [%rd1+16];
    ld.acquire.sys.global.u64 %rd2, [%rd1];
    cvt.u32.u64 %r3, %rd2;
    setp.ne.u32 %p2, %r3, %r2;
    @%p2 bra GOT;
    mov.u64 %rd22, %globaltimer;
    setp.ge.u64 %p3, %rd22, %rd23;
    @%p3 bra ENDING;
    sub.u64 %rd22, %rd22, %rd21;
    setp.lt.u64 %p3, %rd22, %rd20;
    @%p3 bra POLL;
ENDING:
    // Idle (or old): say so, fence, look once more (module doc).
    mov.u32 %r4, 1;
    st.volatile.global.u32 [%rd1+68], %r4;
    fence.sc.sys;
    ld.volatile.global.v2.u64 {%rd4, %rd5}, [%rd1+16];
    ld.acquire.sys.global.u64 %rd2, [%rd1];
    cvt.u32.u64 %r3, %rd2;
    setp.ne.u32 %p2, %r3, %r2;
    @%p2 bra RESUME;
    mov.u64 %rd6, -1;
    st.shared.u64 [job+16], %rd6;
    bra WAIT;
RESUME:
    mov.u32 %r4, 0;
    st.volatile.global.u32 [%rd1+68], %r4;
GOT:
    shr.u64 %rd6, %rd2, 32;
    setp.ge.u64 %p4, %rd6, 4294967295;
    @%p4 bra TAGGED;
    // Each descriptor word carries the low byte of its copy's seq in its
    // top byte: a word read before the shard stored it (the loads above
    // may be served in any order) is the last copy's. Then the descriptor
    // is read again, after the word's acquire load: the shard stored it
    // before the word, so this read is this copy's.
    cvt.u64.u32 %rd7, %r3;
    and.b64 %rd7, %rd7, 255;
    shr.u64 %rd9, %rd4, 56;
    setp.ne.u64 %p7, %rd9, %rd7;
    shr.u64 %rd9, %rd5, 56;
    setp.ne.or.u64 %p7, %rd9, %rd7, %p7;
    @!%p7 bra UNTAG;
    ld.volatile.global.v2.u64 {%rd4, %rd5}, [%rd1+16];
UNTAG:
    and.b64 %rd4, %rd4, 72057594037927935;
    and.b64 %rd5, %rd5, 72057594037927935;
TAGGED:
    st.shared.v2.u64 [job], {%rd4, %rd5};
    st.shared.u64 [job+16], %rd6;
WAIT:
    bar.sync 0;
    ld.shared.v2.u64 {%rd4, %rd5}, [job];
    ld.shared.u64 %rd6, [job+16];
    setp.ge.u64 %p4, %rd6, 4294967295;
    @%p4 bra EXIT;
    cvta.to.global.u64 %rd4, %rd4;
    cvta.to.global.u64 %rd5, %rd5;
    cvt.u64.u32 %rd8, %r1;
    or.b64 %rd10, %rd4, %rd5;
    or.b64 %rd10, %rd10, %rd6;
    and.b64 %rd10, %rd10, 15;
    setp.ne.u64 %p5, %rd10, 0;
    @%p5 bra BYTELOOP;
    shr.u64 %rd11, %rd6, 4;
WORDS:
    setp.ge.u64 %p6, %rd8, %rd11;
    @%p6 bra COPIED;
    shl.b64 %rd12, %rd8, 4;
    add.s64 %rd13, %rd5, %rd12;
    add.s64 %rd14, %rd4, %rd12;
    ld.global.v4.u32 {%r4, %r5, %r6, %r7}, [%rd13];
    st.global.v4.u32 [%rd14], {%r4, %r5, %r6, %r7};
    add.s64 %rd8, %rd8, 256;
    bra WORDS;
BYTELOOP:
    setp.ge.u64 %p6, %rd8, %rd6;
    @%p6 bra COPIED;
    add.s64 %rd13, %rd5, %rd8;
    add.s64 %rd14, %rd4, %rd8;
    ld.global.u8 %rs1, [%rd13];
    st.global.u8 [%rd14], %rs1;
    add.s64 %rd8, %rd8, 256;
    bra BYTELOOP;
COPIED:
    // Every thread's stores reach the system before the done word.
    membar.sys;
    bar.sync 0;
    @%p1 bra LOOP;
    st.volatile.global.u32 [%rd1+64], %r3;
    mov.u32 %r2, %r3;
    mov.u64 %rd21, %globaltimer;
    bra LOOP;
EXIT:
    ret;
}
"#,
    "\0"
);
