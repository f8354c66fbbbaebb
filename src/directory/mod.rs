//! Peers find each other by name (feature `directory`): an endpoint
//! publishes itself in etcd under `ferry/<cluster>/<name>/endpoint` — its
//! metadata bytes and an incarnation number — and, under the same lease,
//! named windows (`…/windows/<window>`), so that everything it published
//! vanishes when the process dies (the lease is not renewed) or closes
//! (the lease is revoked). Others `lookup`, `window`, `watch` and
//! `connect_by_name`, which forgets a memoized connection when the peer's
//! incarnation changes.
//!
//! etcd is reached through its v3 JSON gateway over a small blocking
//! HTTP/1.1 client (`http.rs`): no gRPC stack, no async runtime in the
//! user's build. The directory is off the data path: its calls and the
//! lease keep-alive thread never touch a shard, so an unreachable etcd
//! fails directory calls (with the address and the reason) and leaves
//! existing connections working.

mod error;
pub mod etcd;
mod http;
mod tls;
mod url;

pub use error::{DirError, Result};
pub use tls::EtcdSecurity;
pub use url::parse_url;
use url::target;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use etcd::{Change, Etcd};

use crate::endpoint::Endpoint;
use crate::error::ConnId;

/// The longest `publish` waits for a holder of the name that has stopped
/// renewing (a crashed process) to run out (else its lease's granted TTL
/// and a second), and how often it looks.
const MAX_OUTLIVE: Duration = Duration::from_secs(30);
/// The most bytes one name's records may take in an answer (its record
/// and its windows): one oversized record is skipped, not fatal.
const MAX_RECORD_BYTES: usize = 1 << 20;
/// Keys read per page when listing.
const LIST_PAGE_KEYS: usize = 512;
/// The most bytes of keys a listing reads (the rest are left out, and
/// logged): the bound the whole listing had when it was one answer.
const MAX_LIST_KEY_BYTES: usize = http::MAX_BODY;
const OUTLIVE_POLL: Duration = Duration::from_millis(200);

fn check_name(what: &'static str, s: &str) -> Result<()> {
    let ok = !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(DirError::Bad {
            what,
            value: s.to_owned(),
            why: "1 to 128 of A-Z a-z 0-9 . _ -".into(),
        })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A published endpoint as others see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The name it is published under.
    pub name: String,
    /// The endpoint's metadata bytes (the seed's format): `add_remote` them.
    pub metadata: Vec<u8>,
    /// Random per publication: a restarted peer has a new one.
    pub incarnation: u64,
    /// The address its metadata names.
    pub addr: SocketAddr,
    /// (window name, its `RemoteBuf`/`IpcBuf` bytes), by name.
    pub windows: Vec<(String, Vec<u8>)>,
}

/// What a watch saw of one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Published (first time, or again after a restart: a new incarnation).
    Up {
        /// The publication's incarnation.
        incarnation: u64,
    },
    /// Its entry is gone: the process closed, died, or lost its lease.
    Gone,
    /// A window of this name was published (or published again).
    WindowSet(String),
    /// The window of this name was removed.
    WindowGone(String),
}

/// A client of the directory of one cluster.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let ep = ferry::Endpoint::builder().build()?;
/// # let client = ferry::Endpoint::builder().build()?;
/// use ferry::directory::Directory;
/// let dir = Directory::new("http://127.0.0.1:2379", "ferry")?;
/// // The target: its name held while `_held` lives (a lease, renewed).
/// let _held = dir.publish(&ep, "prefill-0", std::time::Duration::from_secs(10))?;
/// // A peer: from the name to a connection.
/// let conn = dir.connect_by_name(&client, "prefill-0")?;
/// # let _ = conn;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Directory {
    etcd: Etcd,
    cluster: String,
    /// name -> (incarnation, connection) made by `connect_by_name`.
    memo: Mutex<HashMap<String, (u64, ConnId)>>,
}

impl Directory {
    /// A directory in etcd at `url` (`http://127.0.0.1:2379`, or
    /// `https://…` with a CA) for `cluster`, with the TLS and
    /// authentication settings of the environment
    /// ([`EtcdSecurity::from_env`]). Nothing is contacted yet. Each call
    /// waits at most 2 s.
    pub fn new(url: &str, cluster: &str) -> Result<Directory> {
        Self::with_security(url, cluster, &EtcdSecurity::from_env())
    }

    /// As [`Directory::new`], with these TLS and authentication settings.
    pub fn with_security(url: &str, cluster: &str, sec: &EtcdSecurity) -> Result<Directory> {
        check_name("cluster", cluster)?;
        Ok(Directory {
            etcd: Etcd::new(
                target(url, sec)?,
                Duration::from_secs(2),
                sec.credentials()?,
            ),
            cluster: cluster.to_owned(),
            memo: Mutex::new(HashMap::new()),
        })
    }

    /// Each etcd call's deadline (connect, and each read).
    pub fn set_timeout(&mut self, t: Duration) {
        self.etcd.timeout = t;
    }

    fn prefix(&self, name: &str) -> String {
        format!("ferry/{}/{name}/", self.cluster)
    }

    /// Publishes `ep` as `name` under a lease of `ttl` (at least 2 s; the
    /// entries vanish at most `ttl` after this process stops renewing it).
    /// A name a live publication holds is refused (`DirError::Taken`): the
    /// record is created only if absent (an etcd transaction). A holder
    /// that stopped renewing (a crashed process) is waited out: up to its
    /// lease's TTL, which is also how long telling a live holder takes.
    pub fn publish(&self, ep: &Endpoint, name: &str, ttl: Duration) -> Result<Publication> {
        self.publish_as(ep, name, ttl, false)
    }

    /// As `publish`, but a live holder of `name` is replaced; it learns so
    /// on its next renewal (its `last_error`, a warning) and stops
    /// renewing the name.
    pub fn publish_replacing(
        &self,
        ep: &Endpoint,
        name: &str,
        ttl: Duration,
    ) -> Result<Publication> {
        self.publish_as(ep, name, ttl, true)
    }

    fn publish_as(
        &self,
        ep: &Endpoint,
        name: &str,
        ttl: Duration,
        replace: bool,
    ) -> Result<Publication> {
        check_name("name", name)?;
        let ttl_s = ttl.as_secs().max(2);
        let lease = self.etcd.grant(ttl_s)?;
        let incarnation = crate::sys::random_u64();
        let record = format!("v1 {incarnation:016x} {}", hex(&ep.metadata_bytes()));
        let prefix = self.prefix(name);
        let shared = Arc::new(Shared {
            etcd: self.etcd.clone(),
            prefix: prefix.clone(),
            record,
            lease: Mutex::new(lease),
            ttl_s,
            windows: Mutex::new(Vec::new()),
            last_error: Mutex::new(None),
        });
        let key = format!("{prefix}endpoint");
        if replace {
            self.etcd
                .put(key.as_bytes(), shared.record.as_bytes(), lease)?;
        } else if let Err(e) = self.create_or_outlive(&key, &shared.record, lease) {
            let _ = self.etcd.revoke(lease);
            return Err(match e {
                Some(e) => e,
                None => DirError::Taken {
                    name: name.to_owned(),
                    incarnation: self.lookup(name).map(|e| e.incarnation).unwrap_or_default(),
                },
            });
        }
        // The name is ours: windows of an earlier incarnation are not ours
        // to keep.
        self.etcd
            .delete_prefix(format!("{prefix}windows/").as_bytes())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (s2, stop2) = (shared.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("ferry-directory".into())
            .spawn(move || s2.keep_alive(&stop2))
            .map_err(|e| crate::error::Error::io("spawn the directory keep-alive thread", e))?;
        Ok(Publication {
            shared,
            incarnation,
            stop,
            thread: Some(thread),
        })
    }

    /// Creates the record at `key` if it is absent. A holder that no
    /// longer renews its lease (a crashed process) is outlived: its lease
    /// runs out within its granted TTL, so we wait that long (plus a
    /// second, at most `MAX_OUTLIVE`) for the record to go, and create ours
    /// then; a record still there after that, or whose lease's time to live
    /// went up meanwhile, has a live holder. `Err(None)`: held by one.
    fn create_or_outlive(
        &self,
        key: &str,
        record: &str,
        lease: i64,
    ) -> std::result::Result<(), Option<DirError>> {
        let start = Instant::now();
        let mut deadline = start + MAX_OUTLIVE;
        let mut last_left = i64::MAX;
        loop {
            let created = self.etcd.create(key.as_bytes(), record.as_bytes(), lease);
            if created.map_err(|e| Some(e.into()))? {
                return Ok(());
            }
            let holder = self.etcd.get(key.as_bytes()).map_err(|e| Some(e.into()))?;
            let Some(holder) = holder else { continue };
            // A record under no lease never runs down.
            if holder.lease == 0 {
                return Err(None);
            }
            let (left, granted) = self
                .etcd
                .time_to_live(holder.lease)
                .map_err(|e| Some(e.into()))?;
            // A lease that ran out (or that etcd no longer knows) answers
            // a granted TTL of 0: its keys are on their way out, so it
            // sets no deadline of its own (MAX_OUTLIVE still bounds us).
            if left > 0 {
                let outlived = start + Duration::from_secs(granted.max(0) as u64 + 1);
                deadline = deadline.min(outlived);
            }
            if left > last_left || Instant::now() >= deadline {
                return Err(None);
            }
            last_left = left;
            std::thread::sleep(OUTLIVE_POLL);
            // Our own lease lives through the wait.
            self.etcd.keepalive(lease).map_err(|e| Some(e.into()))?;
        }
    }

    fn entry_from(&self, name: &str, kvs: &[etcd::Kv]) -> Result<Option<Entry>> {
        let prefix = self.prefix(name);
        let mut entry = None;
        let mut windows = Vec::new();
        for kv in kvs {
            let key = String::from_utf8_lossy(&kv.key).into_owned();
            let Some(rest) = key.strip_prefix(&prefix) else {
                continue;
            };
            if rest == "endpoint" {
                let v = String::from_utf8_lossy(&kv.value).into_owned();
                let bad = |why: &str| DirError::Bad {
                    what: "directory record",
                    value: key.clone(),
                    why: why.to_owned(),
                };
                let mut it = v.split(' ');
                if it.next() != Some("v1") {
                    return Err(bad("unknown record version"));
                }
                let inc = it
                    .next()
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    .ok_or_else(|| bad("bad incarnation"))?;
                let metadata = it
                    .next()
                    .and_then(unhex)
                    .ok_or_else(|| bad("bad metadata"))?;
                let m = crate::wire::EndpointMetadata::decode(&metadata)
                    .map_err(|e| bad(&e.to_string()))?;
                entry = Some((inc, metadata, m.socket_addr()));
            } else if let Some(w) = rest.strip_prefix("windows/") {
                if let Some(b) = unhex(&String::from_utf8_lossy(&kv.value)) {
                    windows.push((w.to_owned(), b));
                }
            }
        }
        Ok(entry.map(|(incarnation, metadata, addr)| Entry {
            name: name.to_owned(),
            metadata,
            incarnation,
            addr,
            windows,
        }))
    }

    /// The endpoint published as `name`, with its windows.
    pub fn lookup(&self, name: &str) -> Result<Entry> {
        check_name("name", name)?;
        let kvs = self
            .etcd
            .range_prefix_capped(self.prefix(name).as_bytes(), MAX_RECORD_BYTES)?;
        self.entry_from(name, &kvs)?
            .ok_or_else(|| DirError::NotFound {
                cluster: self.cluster.clone(),
                name: name.to_owned(),
            })
    }

    /// The bytes of window `window` that `name` published.
    pub fn window(&self, name: &str, window: &str) -> Result<Vec<u8>> {
        check_name("window", window)?;
        let e = self.lookup(name)?;
        e.windows
            .into_iter()
            .find(|(w, _)| w == window)
            .map(|(_, b)| b)
            .ok_or_else(|| DirError::NoWindow {
                name: name.to_owned(),
                window: window.to_owned(),
            })
    }

    /// Every endpoint published in the cluster, by name.
    pub fn list(&self) -> Result<Vec<Entry>> {
        // Keys first, a page at a time; then each name's records on their
        // own, bounded: one oversized or bad record costs only its name.
        let cluster = format!("ferry/{}/", self.cluster);
        let (keys, more) =
            self.etcd
                .keys(cluster.as_bytes(), LIST_PAGE_KEYS, MAX_LIST_KEY_BYTES)?;
        if more {
            tracing::warn!(
                cluster = %self.cluster,
                "directory: listing only the first {MAX_LIST_KEY_BYTES} bytes of keys"
            );
        }
        let mut names: Vec<String> = keys
            .iter()
            .filter_map(|k| {
                let k = String::from_utf8_lossy(k).into_owned();
                let rest = k.strip_prefix(&cluster)?.to_owned();
                Some(rest.split('/').next()?.to_owned())
            })
            .collect();
        names.dedup();
        let mut out = Vec::new();
        for n in names {
            // One bad record (garbage, another version, too long) must
            // not hide the cluster's other names.
            let kvs = self
                .etcd
                .range_prefix_capped(self.prefix(&n).as_bytes(), MAX_RECORD_BYTES);
            let kvs = match kvs {
                Ok(kvs) => kvs,
                Err(e) => {
                    tracing::warn!(
                        key = %self.prefix(&n),
                        "directory: skipping a record that cannot be read: {e}"
                    );
                    continue;
                }
            };
            match self.entry_from(&n, &kvs) {
                Ok(Some(e)) => out.push(e),
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    key = %self.prefix(&n),
                    "directory: skipping a record that does not parse: {e}"
                ),
            }
        }
        Ok(out)
    }

    /// Watches `name` from now on: restarts, departures, windows.
    pub fn watch(&self, name: &str) -> Result<Watcher> {
        check_name("name", name)?;
        let prefix = self.prefix(name);
        let w = self.etcd.watch(prefix.as_bytes())?;
        Ok(Watcher {
            w,
            prefix,
            pending: Default::default(),
        })
    }

    /// A connection to the endpoint published as `name`: the one made
    /// before if the peer is the same incarnation and the connection
    /// lives, else a new one (an older connection to a previous
    /// incarnation is removed first, so `add_remote`'s memo cannot hand
    /// it back).
    pub fn connect_by_name(&self, ep: &Endpoint, name: &str) -> Result<ConnId> {
        let e = self.lookup(name)?;
        let old = self.memo.lock().expect("lock").get(name).copied();
        if let Some((inc, conn)) = old {
            if inc == e.incarnation && ep.peer(conn).is_some() {
                return Ok(conn);
            }
            let _ = ep.remove_remote(conn);
        }
        let conn = ep.add_remote(&e.metadata)?;
        self.memo
            .lock()
            .expect("lock")
            .insert(name.to_owned(), (e.incarnation, conn));
        Ok(conn)
    }
}

/// What a publication's keep-alive thread shares with its handle.
struct Shared {
    etcd: Etcd,
    prefix: String,
    record: String,
    lease: Mutex<i64>,
    ttl_s: u64,
    windows: Mutex<Vec<(String, Vec<u8>)>>,
    last_error: Mutex<Option<String>>,
}

impl Shared {
    /// Publishes the record anew under `lease` (after the old one expired)
    /// if nobody took the name meanwhile, then the windows.
    fn put_all(&self, lease: i64) -> Result<()> {
        let key = format!("{}endpoint", self.prefix);
        if !self
            .etcd
            .create(key.as_bytes(), self.record.as_bytes(), lease)?
            && !self.still_ours()?
        {
            return Err(self.lost());
        }
        for (w, b) in self.windows.lock().expect("lock").iter() {
            let key = format!("{}windows/{w}", self.prefix);
            self.etcd.put(key.as_bytes(), hex(b).as_bytes(), lease)?;
        }
        Ok(())
    }

    /// Renews the lease every third of its TTL until `stop`. A lease that
    /// expired meanwhile (etcd unreachable for longer than the TTL) is
    /// replaced and everything published again; errors are kept for
    /// `Publication::last_error` and retried on the next tick.
    fn keep_alive(&self, stop: &AtomicBool) {
        let tick = Duration::from_millis(self.ttl_s * 1000 / 3);
        let step = Duration::from_millis(50);
        loop {
            let mut waited = Duration::ZERO;
            while waited < tick {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(step);
                waited += step;
            }
            let lease = *self.lease.lock().expect("lock");
            // A record replaced by another publisher is not renewed.
            if matches!(self.still_ours(), Ok(false)) {
                let e = self.lost();
                tracing::warn!("{e}");
                *self.last_error.lock().expect("lock") = Some(e.to_string());
                let _ = self.etcd.revoke(lease);
                // Nothing left to revoke when the publication drops.
                *self.lease.lock().expect("lock") = 0;
                return;
            }
            let r = match self.etcd.keepalive(lease) {
                Ok(ttl) if ttl > 0 => Ok(()),
                Ok(_) => self
                    .etcd
                    .grant(self.ttl_s)
                    .map_err(DirError::from)
                    .and_then(|l| {
                        *self.lease.lock().expect("lock") = l;
                        self.put_all(l)
                    }),
                Err(e) => Err(e.into()),
            };
            *self.last_error.lock().expect("lock") = r.err().map(|e| e.to_string());
        }
    }
}

impl Shared {
    /// Whether the name's record is still this publication's (absent, as
    /// after our lease expired, counts as ours: we may create it again).
    fn still_ours(&self) -> Result<bool> {
        let key = format!("{}endpoint", self.prefix);
        Ok(self
            .etcd
            .get(key.as_bytes())?
            .map_or(true, |kv| kv.value == self.record.as_bytes()))
    }

    fn lost(&self) -> DirError {
        DirError::Bad {
            what: "publication",
            value: self.prefix.clone(),
            why: "another endpoint took the name over; this one no longer renews it".into(),
        }
    }
}

/// A live publication: renewed by a thread of its own; dropping it (or
/// `close`) revokes the lease, removing every entry at once.
pub struct Publication {
    shared: Arc<Shared>,
    incarnation: u64,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Publication {
    /// This publication's incarnation (random; a restart makes a new one).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Publishes window `name` (the bytes of a `RemoteBuf` or `IpcBuf`)
    /// under this publication's lease.
    pub fn add_window(&self, name: &str, bytes: &[u8]) -> Result<()> {
        check_name("window", name)?;
        let lease = *self.shared.lease.lock().expect("lock");
        let key = format!("{}windows/{name}", self.shared.prefix);
        self.shared
            .etcd
            .put(key.as_bytes(), hex(bytes).as_bytes(), lease)?;
        let mut w = self.shared.windows.lock().expect("lock");
        w.retain(|(n, _)| n != name);
        w.push((name.to_owned(), bytes.to_vec()));
        Ok(())
    }

    /// Removes window `name` from the publication.
    pub fn remove_window(&self, name: &str) -> Result<()> {
        check_name("window", name)?;
        self.shared
            .windows
            .lock()
            .expect("lock")
            .retain(|(n, _)| n != name);
        let key = format!("{}windows/{name}", self.shared.prefix);
        self.shared.etcd.delete_prefix(key.as_bytes())?;
        Ok(())
    }

    /// The keep-alive's last failure, if its last attempt failed.
    pub fn last_error(&self) -> Option<String> {
        self.shared.last_error.lock().expect("lock").clone()
    }

    /// Stops renewing without revoking: the entries stay until the lease
    /// expires, as after a crash (for tests and for handing over).
    pub fn abandon(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        std::mem::forget(self);
    }

    /// Revokes the lease: every entry goes at once.
    pub fn close(self) {}
}

impl Drop for Publication {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let lease = *self.shared.lease.lock().expect("lock");
        if lease == 0 {
            return;
        }
        if let Err(e) = self.shared.etcd.revoke(lease) {
            tracing::warn!("directory: revoking lease {lease:x}: {e} (its entries expire with it)");
        }
    }
}

/// An open watch of one name.
pub struct Watcher {
    w: etcd::Watch,
    prefix: String,
    pending: std::collections::VecDeque<Event>,
}

impl Watcher {
    /// The next event, waiting at most `wait`; `Ok(None)` when none came.
    pub fn next(&mut self, wait: Duration) -> Result<Option<Event>> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(Some(e));
            }
            let Some(left) = http::left(deadline) else {
                return Ok(None);
            };
            let Some(changes) = self.w.next(left)? else {
                return Ok(None);
            };
            for c in changes {
                let (key, put) = match &c {
                    Change::Put(kv) => (kv.key.clone(), Some(kv)),
                    Change::Delete(k) => (k.clone(), None),
                };
                let key = String::from_utf8_lossy(&key).into_owned();
                let Some(rest) = key.strip_prefix(&self.prefix) else {
                    continue;
                };
                let ev = match (rest, put) {
                    ("endpoint", Some(kv)) => {
                        let v = String::from_utf8_lossy(&kv.value).into_owned();
                        let inc = v
                            .split(' ')
                            .nth(1)
                            .and_then(|h| u64::from_str_radix(h, 16).ok())
                            .unwrap_or(0);
                        Event::Up { incarnation: inc }
                    }
                    ("endpoint", None) => Event::Gone,
                    (w, p) => match w.strip_prefix("windows/") {
                        Some(w) if p.is_some() => Event::WindowSet(w.to_owned()),
                        Some(w) => Event::WindowGone(w.to_owned()),
                        None => continue,
                    },
                };
                self.pending.push_back(ev);
            }
        }
    }
}

#[cfg(test)]
mod tests;
