use super::*;
use crate::codec::Codec;
use crate::error::ConnId;
use crate::region::{Grant, Region, RegionTable};
use crate::tcp::proto::{Step, StreamLimits};
use crate::xfer::testing::{bytes_of, owned_region, RecSink, View};
use std::collections::VecDeque;

const RKEY: u32 = 0x77;
const TAG: u64 = 0x99;

fn shared(held_max: usize) -> PackShared {
    PackShared {
        mode: PackMode::On,
        codec_rate: Arc::default(),
        held: Arc::default(),
        held_max,
        stats: Arc::default(),
    }
}

/// A target stream that packs, over a 4 MiB region.
fn target(held_max: usize) -> (StreamProto, RegionTable, Arc<Region>) {
    let limits = StreamLimits {
        own_max: 8,
        peer_max: 8,
        codec: true,
    };
    let mut s = StreamProto::new(limits, 0, None);
    s.enable_pack(shared(held_max));
    let mem = owned_region(4 << 20, RKEY, TAG);
    let mut table = RegionTable::default();
    table.insert(RKEY, Grant::whole(&mem));
    (s, table, mem)
}

/// A WriteReq for `len` bytes at `mem`'s start carrying `frame` packed.
fn packed_write(mem: &Region, len: u64, frame: &[u8]) -> Vec<u8> {
    let h = DataHeader::request(DataKind::WriteReq, RKEY, TAG, 1, mem.addr(), len)
        .packed(frame.len() as u32);
    let mut b = h.encode().to_vec();
    b.extend_from_slice(frame);
    b
}

fn bf16_chunk(len: usize) -> Vec<u8> {
    (0..len / 2)
        .flat_map(|i| (0x3c00u16 + (i % 7) as u16 * 0x80 + (i % 13) as u16).to_le_bytes())
        .collect()
}

/// Feeds `wire` to `s` and runs what it queues with a real codec, as
/// the pool would; returns the first error `codec_done` gave.
fn serve(s: &mut StreamProto, table: &RegionTable, wire: &[u8]) -> Result<(), ConnFault> {
    let (mut done, mut inbox) = (Vec::new(), VecDeque::new());
    let mut sink = RecSink {
        done: &mut done,
        inbox: &mut inbox,
        cap: 4,
    };
    let mut view = View {
        table,
        conn: ConnId(1),
    };
    let now = Instant::now();
    let mut fed = 0;
    while fed < wire.len() {
        fed += s.receive_bytes(&wire[fed..], now);
        while s.step(&mut view, &mut sink)? == Step::Progress {}
    }
    let mut codec = Codec::new().unwrap();
    let jobs: Vec<_> = s.take_codec_jobs().collect();
    for job in jobs {
        let CodecWork::Decode { frame, dst } = job.work else {
            panic!("a target decodes")
        };
        // SAFETY: `dst` is the checked window of the test's region.
        let into = unsafe { std::slice::from_raw_parts_mut(dst.ptr(), dst.len()) };
        let result = codec.decode(&frame, into).map(|_| ()).map_err(|e| {
            ConnFault::misbehaved(format!("a packed frame from the peer is bad: {e}"))
        });
        let outcome = CodecOutcome::Decoded { buf: frame, result };
        s.codec_done(job.ticket, outcome, &mut sink)?;
    }
    Ok(())
}

#[test]
fn a_packed_write_lands_exactly_and_is_acked_after_its_decode() {
    let (mut s, table, mem) = target(1 << 30);
    let chunk = bf16_chunk(1 << 20);
    let mut frame = Vec::new();
    assert!(Codec::new()
        .unwrap()
        .pack(FloatType::Bf16, &chunk, &mut frame)
        .unwrap());
    serve(
        &mut s,
        &table,
        &packed_write(&mem, chunk.len() as u64, &frame),
    )
    .unwrap();
    assert_eq!(bytes_of(&mem, 0, chunk.len()), &chunk[..]);
    assert!(s.tx_ready(), "the ack is released");
    assert_eq!(
        s.pack.as_ref().unwrap().shared.held.load(Ordering::Relaxed),
        0
    );
}

#[test]
fn a_bomb_fails_the_connection_and_writes_nothing_past_the_request() {
    let (mut s, table, mem) = target(1 << 30);
    // A frame of 2 MiB (of zeros: a few hundred bytes packed) for a
    // request of 64 KiB.
    let chunk = vec![0u8; 2 << 20];
    let mut frame = Vec::new();
    assert!(Codec::new()
        .unwrap()
        .pack(FloatType::Bytes, &chunk, &mut frame)
        .unwrap());
    assert!(frame.len() < 64 << 10, "the bomb is small on the wire");
    let mem_len = mem.len();
    fill(&mem, 0x5a, mem_len);
    let err = serve(&mut s, &table, &packed_write(&mem, 64 << 10, &frame)).unwrap_err();
    assert!(
        err.to_string()
            .contains("decodes to 2097152 bytes where 65536"),
        "{err}"
    );
    let untouched = bytes_of(&mem, 64 << 10, mem_len - (64 << 10));
    assert!(
        untouched.iter().all(|&b| b == 0x5a),
        "written past the request"
    );
    assert!(!s.tx_ready(), "no ack for it");
}

#[test]
fn a_frame_that_fails_its_checksum_fails_the_connection() {
    let (mut s, table, mem) = target(1 << 30);
    let chunk = bf16_chunk(256 << 10);
    let mut frame = Vec::new();
    assert!(Codec::new()
        .unwrap()
        .pack(FloatType::Bf16, &chunk, &mut frame)
        .unwrap());
    // The last byte of the zstd frame is its checksum's.
    let packed = u32::from_le_bytes(frame[8..12].try_into().unwrap()) as usize;
    frame[FRAME_AT + packed - 1] ^= 0x40;
    let err = serve(
        &mut s,
        &table,
        &packed_write(&mem, chunk.len() as u64, &frame),
    );
    let err = err.unwrap_err();
    assert!(err.to_string().contains("checksum"), "{err}");
}

const FRAME_AT: usize = crate::codec::FRAME_HEADER;

pub(super) fn fill(mem: &Region, b: u8, len: usize) {
    crate::xfer::testing::write_into(mem, 0, &vec![b; len]);
}

#[test]
fn a_packed_frame_without_the_codec_agreed_is_refused() {
    let limits = StreamLimits {
        own_max: 8,
        peer_max: 8,
        codec: false,
    };
    let mut s = StreamProto::new(limits, 0, None);
    let mem = owned_region(1 << 20, RKEY, TAG);
    let mut table = RegionTable::default();
    table.insert(RKEY, Grant::whole(&mem));
    let err = serve(&mut s, &table, &packed_write(&mem, 1000, &[0; 100])).unwrap_err();
    assert!(
        err.to_string().contains("did not agree to the codec"),
        "{err}"
    );
}

#[test]
fn held_bytes_are_bounded_endpoint_wide() {
    // Room for one frame: the second waits unread until it is decoded.
    let (mut s, table, mem) = target(100 << 10);
    let chunk = bf16_chunk(1 << 20);
    let mut frame = Vec::new();
    assert!(Codec::new()
        .unwrap()
        .pack(FloatType::Bf16, &chunk, &mut frame)
        .unwrap());
    assert!(frame.len() > 50 << 10);
    let one = packed_write(&mem, chunk.len() as u64, &frame);
    let (mut done, mut inbox) = (Vec::new(), VecDeque::new());
    let mut sink = RecSink {
        done: &mut done,
        inbox: &mut inbox,
        cap: 4,
    };
    let mut view = View {
        table: &table,
        conn: ConnId(1),
    };
    let wire = [one.clone(), one].concat();
    let mut fed = 0;
    let blocked = loop {
        fed += s.receive_bytes(&wire[fed..], Instant::now());
        let step = loop {
            match s.step(&mut view, &mut sink).unwrap() {
                Step::Progress => continue,
                other => break other,
            }
        };
        if step == Step::Blocked || fed == wire.len() {
            break step;
        }
    };
    assert_eq!(blocked, Step::Blocked, "the second frame was taken");
    let held = s.pack.as_ref().unwrap().shared.held.clone();
    assert_eq!(held.load(Ordering::Relaxed), frame.len());
    let jobs: Vec<_> = s.take_codec_jobs().collect();
    assert_eq!(jobs.len(), 1);
    // The job's end (here: dropped with its connection) lets it go.
    drop(jobs);
    assert_eq!(held.load(Ordering::Relaxed), 0);
    assert_eq!(s.step(&mut view, &mut sink).unwrap(), Step::Progress);
}

#[test]
fn the_meter_measures_only_while_the_socket_pushes_back() {
    let t0 = Instant::now();
    let ms = |n| t0 + std::time::Duration::from_millis(n);
    let mut m = LinkMeter::default();
    m.sent(10 << 20, ms(1));
    assert_eq!(m.rate(), None, "not blocked: the link is not measured");
    m.blocked(ms(10));
    m.sent(1 << 20, ms(20));
    let r = m.rate().expect("a sample");
    assert!((r - 104_857_600.0).abs() < 1.0, "{r}");
    m.drained();
    m.sent(100 << 20, ms(21));
    assert_eq!(m.rate(), Some(r), "drained: no sample");
}
