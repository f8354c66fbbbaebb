//! Measuring: the windows of ops in flight, one pump loop, percentiles.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry::stage_trace::{self, Stage};
use ferry::{AnyWindow, Batch, ConnId, Endpoint, MemoryRegion, OpKind, Shard, Transfer};
use ferry_cli::testkit::cpu_ns;

use crate::args::fmt_size;

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub(super) fn median(v: &[f64]) -> f64 {
    percentile(&sorted(v.to_vec()), 0.5)
}

pub(super) fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN latencies"));
    v
}

/// The completions one measuring loop counts: those that end inside
/// [`warm_end`, `end`) (the pipeline is kept full from start to `end`, so
/// bytes queued before the window or drained after it never skew the rate).
pub(super) struct Window {
    pub(super) warm_end: Instant,
    pub(super) end: Instant,
    pub(super) first: Option<Instant>,
    pub(super) last: Instant,
    pub(super) count: u64,
    /// Per-op latencies in µs (at most the capacity given).
    pub(super) lat: Vec<f64>,
}

impl Window {
    pub(super) fn new(warm_end: Instant, end: Instant, lat_cap: usize) -> Window {
        Window {
            warm_end,
            end,
            first: None,
            last: warm_end,
            count: 0,
            lat: Vec::with_capacity(lat_cap),
        }
    }

    /// Takes the finished ops out of `flight`, counting those that ended
    /// inside the window: on each connection those at the front, in order
    /// (one connection's ops end in order), without looking further — so a
    /// pass looks at one op per connection that has not ended, not at every
    /// op in flight, and one slow connection never holds up the others.
    pub(super) fn reap(&mut self, flight: &mut Flight, op: OpKind, size: usize) -> Result<usize> {
        let mut done_now = None;
        let mut reaped = 0;
        let Flight { conns, len } = flight;
        for q in conns.iter_mut() {
            while let Some(front) = q.front_mut() {
                let Some(r) = front.0.poll() else {
                    break;
                };
                let (_, started) = q.pop_front().expect("looked at");
                *len -= 1;
                r.with_context(|| format!("{op} of {size} bytes"))?;
                // One clock read per loop pass: reading it per op costs the
                // initiator a visible share of its time.
                let done = *done_now.get_or_insert_with(Instant::now);
                if done >= self.warm_end && done < self.end {
                    if self.lat.len() < self.lat.capacity() {
                        self.lat.push((done - started).as_secs_f64() * 1e6);
                    }
                    self.first.get_or_insert(done);
                    self.last = self.last.max(done);
                    self.count += 1;
                }
                reaped += 1;
            }
        }
        Ok(reaped)
    }

    /// Another loop's count, over the same window.
    pub(super) fn merge(&mut self, mut o: Window) {
        if let Some(f) = o.first {
            self.first = Some(self.first.map_or(f, |x| x.min(f)));
        }
        self.last = self.last.max(o.last);
        self.count += o.count;
        self.lat.append(&mut o.lat);
    }

    /// (GB/s, ops/s) between the first and the last completion: the bytes
    /// of the ops completed after the first one, over that time.
    pub(super) fn rate(&self, op: OpKind, size: usize, secs: f64) -> Result<(f64, f64)> {
        let Some(first) = self.first.filter(|_| self.count >= 2) else {
            bail!(
                "{op} of {}: fewer than 2 operations completed in {secs} s; use a longer --seconds",
                fmt_size(size)
            );
        };
        let window = (self.last - first).as_secs_f64().max(1e-9);
        let ops = (self.count - 1) as f64;
        Ok((ops * size as f64 / window / 1e9, ops / window))
    }
}

/// How an op is started: queued to its shard, staged in a batch, or
/// applied by the embedded shard this thread drives (`write_async_on`).
pub(super) enum Via<'a, 'b> {
    Queue,
    Batch(&'a mut Batch<'b>),
    Shard(&'a mut Shard),
}

impl<'a, 'b> From<Option<&'a mut Batch<'b>>> for Via<'a, 'b> {
    fn from(b: Option<&'a mut Batch<'b>>) -> Self {
        b.map_or(Via::Queue, Via::Batch)
    }
}

/// Starts one op of `size` bytes at `off` of both the local region and
/// the remote window, on connection `c`, `via` its shard's queue, a batch
/// or the embedded shard.
#[allow(clippy::too_many_arguments)]
pub(super) fn submit_on(
    ep: &Endpoint,
    via: Via<'_, '_>,
    c: ConnId,
    local: &MemoryRegion,
    remote: &AnyWindow,
    op: OpKind,
    off: usize,
    size: usize,
) -> Result<Transfer> {
    let rb = remote
        .slice(off as u64, size as u64)
        .context("remote window")?;
    Ok(match (op, via) {
        (OpKind::Write, Via::Queue) => ep.write_async(c, local, off, size, &rb)?,
        (OpKind::Read, Via::Queue) => ep.read_async(c, local, off, size, &rb)?,
        (OpKind::Write, Via::Batch(b)) => b.write(c, local, off, size, &rb)?,
        (OpKind::Read, Via::Batch(b)) => b.read(c, local, off, size, &rb)?,
        (OpKind::Write, Via::Shard(s)) => ep.write_async_on(s, c, local, off, size, &rb)?,
        (OpKind::Read, Via::Shard(s)) => ep.read_async_on(s, c, local, off, size, &rb)?,
    })
}

/// The ops in flight, each connection's in the order they started.
pub(super) struct Flight {
    conns: Vec<VecDeque<(Transfer, Instant)>>,
    len: usize,
}

impl Flight {
    pub(super) fn new(batch: usize, conns: usize) -> Flight {
        let per = batch.div_ceil(conns.max(1));
        Flight {
            conns: (0..conns.max(1))
                .map(|_| VecDeque::with_capacity(per))
                .collect(),
            len: 0,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The oldest op of the first connection that has one.
    fn front_mut(&mut self) -> Option<&mut Transfer> {
        self.conns
            .iter_mut()
            .find_map(|q| q.front_mut())
            .map(|(t, _)| t)
    }
}

/// Keeps `batch` ops in flight, each connection its share of them
/// (`batch / conns`, the remainder to the first ones), each op made by
/// `submit(staged, k, conn)` for the next `k` (counting on from `*k`). An
/// op that ends is replaced on its own connection: the ops a shard
/// completed together reach it again together, and a slow connection
/// keeps only its share (a turn over the connections would pile new ops
/// onto it). With `burst` (`--submit batch`) only once that many are
/// missing (at most `batch`), all staged in one `Endpoint::batch`. Returns
/// how many it started.
pub(super) fn refill(
    ep: &Endpoint,
    burst: Option<usize>,
    flight: &mut Flight,
    batch: usize,
    now: Instant,
    k: &mut usize,
    mut submit: impl FnMut(Option<&mut Batch<'_>>, usize, usize) -> Result<Transfer>,
) -> Result<usize> {
    let before = *k;
    let missing = batch.saturating_sub(flight.len);
    if missing == 0 || burst.is_some_and(|b| missing < b.min(batch)) {
        return Ok(0);
    }
    let mut staged = burst.map(|_| ep.batch());
    let Flight { conns, len } = flight;
    let n = conns.len();
    for (c, q) in conns.iter_mut().enumerate() {
        let share = share_of(batch, n, c);
        while q.len() < share {
            q.push_back((submit(staged.as_mut(), *k, c)?, now));
            *len += 1;
            *k += 1;
        }
    }
    if let Some(b) = staged {
        b.submit()?;
    }
    Ok(*k - before)
}

/// Connection `c`'s share of `batch` ops over `n` connections: the
/// shares differ by at most one and add up to `batch`.
fn share_of(batch: usize, n: usize, c: usize) -> usize {
    batch / n + usize::from(c < batch % n)
}

/// The refill size of `--submit batch` (`--burst`, else a quarter of the
/// ops in flight); None: per-op submits.
fn burst_of(batched: Option<usize>, batch: usize) -> Option<usize> {
    batched.map(|b| if b == 0 { (batch / 4).max(1) } else { b })
}

/// How a thread feeding managed shards waits for its ops: it polls them
/// all for `SPIN_ANY` after the last one ended, then sleeps on the oldest
/// (its completer wakes it) for up to 1 ms at a time.
#[derive(Default)]
pub(super) struct IdleWait {
    since: Option<Instant>,
}

impl IdleWait {
    const SPIN_ANY: Duration = Duration::from_micros(100);

    pub(super) fn wait_unless(&mut self, progress: bool, flight: &mut Flight) {
        if progress {
            self.since = None;
            return;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        match flight.front_mut() {
            Some(t) if since.elapsed() > Self::SPIN_ANY => {
                let _ = t.wait_timeout(Duration::from_millis(1));
                self.since = None;
            }
            Some(_) => std::hint::spin_loop(),
            None => {}
        }
    }
}

/// One throughput measurement.
pub(super) struct Measured {
    pub(super) gbps: f64,
    pub(super) ops_per_s: f64,
    /// Per-op latencies in µs.
    pub(super) lat: Vec<f64>,
    /// Ops kept in flight (the batch asked for, capped by the windows).
    pub(super) batch: usize,
    /// Mean ns the submitting thread spent inside submit calls per op
    /// (one submitting thread only): what feeding the shards costs it.
    pub(super) submit_ns: Option<f64>,
}

pub(super) struct Bench<'a> {
    pub(super) ep: &'a Endpoint,
    /// The initiator's one embedded shard (None: managed shards, with
    /// --shards > 1). In a cell: ops are submitted on it (`write_async_on`)
    /// from `&self`.
    pub(super) shard: std::cell::RefCell<Option<Shard>>,
    /// The connections measured (--conns), each with its share of the
    /// ops in flight (one-op round trips: used in turn).
    pub(super) conns: Vec<ConnId>,
    pub(super) turn: std::cell::Cell<usize>,
    pub(super) local: MemoryRegion,
    pub(super) remote: AnyWindow,
    /// Bytes per one-op latency round trip.
    pub(super) latency_bytes: usize,
    /// Submitting threads (`--threads`; > 1 only with managed shards).
    pub(super) threads: usize,
    /// Refills go through `Endpoint::batch` (`--submit batch`), each of
    /// at least this many ops (`--burst`; 0: a quarter of the batch).
    pub(super) batched: Option<usize>,
    /// `--submit queue`: ops go through the embedded shard's queue.
    pub(super) queued: bool,
}

impl Bench<'_> {
    /// One op on the next connection in turn.
    pub(super) fn submit(&self, op: OpKind, off: usize, size: usize) -> Result<Transfer> {
        let t = self.turn.get();
        self.turn.set(t.wrapping_add(1));
        self.submit_in(None, t % self.conns.len(), op, off, size)
    }

    /// One op on connection `conn` of `self.conns` (staged in `batch`).
    fn submit_in(
        &self,
        batch: Option<&mut Batch<'_>>,
        conn: usize,
        op: OpKind,
        off: usize,
        size: usize,
    ) -> Result<Transfer> {
        let c = self.conns[conn];
        let mut shard = self.shard.borrow_mut();
        let via = match (batch, shard.as_mut()) {
            (Some(b), _) => Via::Batch(b),
            (None, Some(s)) if !self.queued => Via::Shard(s),
            (None, _) => Via::Queue,
        };
        submit_on(self.ep, via, c, &self.local, &self.remote, op, off, size)
    }

    /// Distinct `size`-byte windows the run cycles through.
    pub(super) fn slots(&self, size: usize) -> usize {
        (self.local.len() / size)
            .min(self.remote.len() as usize / size)
            .max(1)
    }

    /// Keeps `batch` ops of `size` in flight.
    pub(super) fn throughput(
        &mut self,
        op: OpKind,
        size: usize,
        batch: usize,
        secs: f64,
    ) -> Result<Measured> {
        if self.threads > 1 && self.shard.get_mut().is_none() {
            return self.threaded(op, size, batch, secs);
        }
        let slots = self.slots(size);
        let batch = batch.min(slots);
        // The pipeline is kept full from start to `end`; throughput counts
        // the operations that *complete* inside [warm_end, end], so bytes
        // queued before the window or drained after it never skew the rate.
        let warm = Duration::from_secs_f64((secs * 0.15).max(0.05));
        let t0 = Instant::now();
        let warm_end = t0 + warm;
        let end = warm_end + Duration::from_secs_f64(secs);
        let mut inflight = Flight::new(batch, self.conns.len());
        let mut w = Window::new(warm_end, end, 1 << 20);
        let mut k = 0usize;
        // Time inside the refills, and the ops they submitted.
        let (mut submit_time, mut submitted) = (Duration::ZERO, 0u64);
        let mut idle = IdleWait::default();
        loop {
            let now = Instant::now();
            if now < end {
                let this = &*self;
                let n = refill(
                    this.ep,
                    burst_of(this.batched, batch),
                    &mut inflight,
                    batch,
                    now,
                    &mut k,
                    |b, k, c| this.submit_in(b, c, op, (k % slots) * size, size),
                )?;
                if n > 0 {
                    submit_time += now.elapsed();
                    submitted += n as u64;
                }
            } else if inflight.is_empty() {
                break;
            }
            // Like a managed shard: spin while busy, park when idle for a
            // while, so the kernel's own work (softirqs) gets a core.
            // With managed shards this thread polls each connection's
            // oldest op (connections end their ops in any order: waiting
            // on one would let a slow op idle every other shard) and
            // sleeps on one only after a while without any ending.
            if let Some(s) = self.shard.get_mut() {
                s.poll_or_park(Duration::from_millis(1));
            }
            let reaped = w.reap(&mut inflight, op, size)?;
            if self.shard.get_mut().is_none() {
                idle.wait_unless(reaped > 0, &mut inflight);
            }
        }
        let (gbps, ops_per_s) = w.rate(op, size, secs)?;
        Ok(Measured {
            gbps,
            ops_per_s,
            lat: w.lat,
            batch,
            submit_ns: Some(submit_time.as_nanos() as f64 / submitted.max(1) as f64),
        })
    }

    /// `throughput` from `self.threads` threads (managed shards): thread
    /// `i` keeps `batch` ops in flight on connection `i mod conns`, over its
    /// own share of the windows; the rate counts every thread's
    /// completions inside the common window.
    pub(super) fn threaded(
        &mut self,
        op: OpKind,
        size: usize,
        batch: usize,
        secs: f64,
    ) -> Result<Measured> {
        let n = self.threads;
        let per = (self.slots(size) / n).max(1);
        let batch = batch.min(per);
        let warm = Duration::from_secs_f64((secs * 0.15).max(0.05));
        let warm_end = Instant::now() + warm;
        let end = warm_end + Duration::from_secs_f64(secs);
        let (ep, local, remote, conns) = (self.ep, &self.local, &self.remote, &self.conns);
        let batched = burst_of(self.batched, batch);
        let results: Vec<Result<Window>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    sc.spawn(move || -> Result<Window> {
                        let c = conns[i % conns.len()];
                        let base = i * per;
                        let submit = |b: Option<&mut Batch<'_>>, k: usize, _: usize| {
                            let off = (base + k % per) * size;
                            submit_on(ep, b.into(), c, local, remote, op, off, size)
                        };
                        let mut inflight = Flight::new(batch, 1);
                        let mut w = Window::new(warm_end, end, 1 << 16);
                        let mut k = 0usize;
                        loop {
                            let now = Instant::now();
                            if now < end {
                                refill(ep, batched, &mut inflight, batch, now, &mut k, submit)?;
                            } else if inflight.is_empty() {
                                break;
                            }
                            if let Some(t) = inflight.front_mut() {
                                let _ = t.wait_timeout(Duration::from_millis(1));
                            }
                            w.reap(&mut inflight, op, size)?;
                        }
                        Ok(w)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a thread panicked")))
                })
                .collect()
        });
        let mut all = Window::new(warm_end, end, 0);
        for r in results {
            all.merge(r?);
        }
        let (gbps, ops_per_s) = all.rate(op, size, secs)?;
        Ok(Measured {
            gbps,
            ops_per_s,
            lat: all.lat,
            batch: batch * n,
            submit_ns: None,
        })
    }

    /// Leaves the connections idle for `secs` (the initiator parks like a
    /// managed shard), then times one 8-byte WRITE round trip. Returns each
    /// side's CPU use while idle (% of one core) and that round trip (us).
    pub(super) fn idle_probe(&mut self, target_pid: u32, secs: f64) -> Result<(f64, f64, f64)> {
        let me = std::process::id();
        let (here0, there0) = (cpu_ns(me), cpu_ns(target_pid));
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < secs {
            match self.shard.get_mut() {
                Some(s) => {
                    s.poll_or_park(Duration::from_millis(100));
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let wall_ns = start.elapsed().as_nanos() as f64;
        let (here1, there1) = (cpu_ns(me), cpu_ns(target_pid));
        let pct = |a: u64, b: u64| b.saturating_sub(a) as f64 / wall_ns * 100.0;
        let t = Instant::now();
        let mut tr = self.submit(OpKind::Write, 0, 8)?;
        let r = loop {
            // A waiter that spins but yields its core (as a shard's spin
            // does, and as the reference's waiter does): the peer we woke
            // may need this core.
            if let Some(s) = self.shard.get_mut() {
                s.poll();
            }
            std::thread::yield_now();
            if let Some(r) = tr.poll() {
                break r;
            }
        };
        let rtt_us = t.elapsed().as_secs_f64() * 1e6;
        r?;
        Ok((pct(here0, here1), pct(there0, there1), rtt_us))
    }

    /// Two-sided round trips of `len`-byte messages for `secs`: a send to
    /// the target, which echoes it (`msg-echo`), and its receive here;
    /// returns latencies in us.
    pub(super) fn message_latency(&mut self, len: usize, secs: f64) -> Result<Vec<f64>> {
        let conn = self.conns[0];
        let (out, back) = (self.ep.alloc(len)?, self.ep.alloc(len)?);
        self.ep
            .send_notification(conn, format!("msg-echo 100000000 {len}").as_bytes())?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.turn_shard();
            match self.ep.try_recv_notification() {
                Some((_, m)) if m == b"ok" => break,
                Some((_, m)) => bail!("msg-echo: {}", String::from_utf8_lossy(&m)),
                None if Instant::now() > deadline => bail!("msg-echo: no answer in 10 s"),
                None => {}
            }
        }
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::with_capacity(1 << 20);
        let mut n = 0u64;
        let mut last = false;
        while !last {
            // An empty message ends the target's echo (and this loop).
            last = Instant::now() >= end;
            let size = if last { 0 } else { len };
            let start = Instant::now();
            let r = self.ep.recv_async(conn, &back, 0, len)?;
            let s = self.ep.send_async(conn, &out, 0, size)?;
            let (mut sent, mut got) = (false, false);
            while !(sent && got) {
                self.turn_shard();
                if !sent {
                    sent = self.ep.poll_message(s).transpose()?.is_some();
                }
                if !got {
                    got = self.ep.poll_message(r).transpose()?.is_some();
                }
                if Instant::now() > end + Duration::from_secs(10) {
                    bail!("a message round trip took over 10 s");
                }
            }
            n += 1;
            if !last && lat.len() < lat.capacity() {
                lat.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        drop_warm_up(&mut lat);
        if lat.is_empty() {
            bail!("message round trips: {n} in {secs} s, all warming up; use a longer --seconds");
        }
        Ok(lat)
    }

    /// One pass of the embedded shard, if there is one (else the managed
    /// shards run by themselves).
    fn turn_shard(&self) {
        if let Some(s) = self.shard.borrow_mut().as_mut() {
            s.poll_or_park(Duration::from_millis(1));
        }
    }

    /// One op of `latency_bytes` at a time; returns latencies in us.
    pub(super) fn latency(&mut self, op: OpKind, secs: f64) -> Result<Vec<f64>> {
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::with_capacity(1 << 20);
        let mut gaps = super::stages::Gaps::default();
        let mut n = 0u64;
        while Instant::now() < end {
            let start = Instant::now();
            stage_trace::mark(Stage::Submit);
            let mut t = self.submit(op, 0, self.latency_bytes)?;
            stage_trace::mark(Stage::Submitted);
            let r = loop {
                match self.shard.get_mut() {
                    Some(s) => {
                        s.poll_or_park(Duration::from_millis(1));
                    }
                    None => {
                        let _ = t.wait_timeout(Duration::from_millis(1));
                    }
                }
                if let Some(r) = t.poll() {
                    break r;
                }
            };
            r?;
            stage_trace::mark(Stage::Seen);
            n += 1;
            if lat.len() < lat.capacity() {
                lat.push(start.elapsed().as_secs_f64() * 1e6);
            }
            if n > WARM_UP_MAX as u64 {
                gaps.record();
            }
        }
        gaps.print();
        drop_warm_up(&mut lat);
        if lat.is_empty() {
            // Percentiles of nothing would print NaN (and break --json).
            bail!("{op} round trips: {n} in {secs} s, all warming up; use a longer --seconds");
        }
        Ok(lat)
    }
}

/// Round trips at the start that only warm caches and the peer's spin loop.
const WARM_UP_MAX: usize = 100;

/// Leaves out the first round trips (up to `WARM_UP_MAX`, never more than
/// half, so a busy machine, where each round trip waits for a thread to be
/// scheduled and few fit in the time, still gets a figure).
fn drop_warm_up(lat: &mut Vec<f64>) {
    let warm = (lat.len() / 2).min(WARM_UP_MAX);
    lat.drain(..warm);
}

#[cfg(test)]
mod tests {
    use super::share_of;

    #[test]
    fn connection_shares_add_up_to_the_batch_and_differ_by_at_most_one() {
        for batch in 1..70 {
            for n in 1..9 {
                let shares: Vec<usize> = (0..n).map(|c| share_of(batch, n, c)).collect();
                assert_eq!(shares.iter().sum::<usize>(), batch, "{batch} over {n}");
                let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
                assert!(hi - lo <= 1, "{batch} over {n}: {shares:?}");
            }
        }
    }
}
