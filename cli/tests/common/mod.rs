//! Shared test helpers: a `ferry serve` target in its own process, and
//! client endpoints on 127.0.0.1.

#![allow(dead_code)]

pub mod hosts;

use std::io::BufReader;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferry::oob::IoPreference;
use ferry::{Config, ConnId, Endpoint, Mode, Transport};
use ferry_cli::testkit::{read_served, Served};

/// Fails the calling test, saying why, where the kernel refuses io_uring:
/// a suite arm that did not run must not count as passed. (Leave those
/// arms out with `cargo test -- --skip uring` on such a machine.)
pub fn require_backend(io: IoPreference) {
    if io == IoPreference::Uring {
        if let Err(why) = ferry::oob::probe_uring() {
            panic!("io_uring is not usable here ({why}); run with --skip uring to leave it out");
        }
    }
}

pub fn io_name(io: IoPreference) -> &'static str {
    match io {
        IoPreference::Uring => "uring",
        IoPreference::Epoll => "epoll",
        IoPreference::Auto => "auto",
    }
}

/// Which data path and control backend a suite runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    TcpUring,
    TcpEpoll,
    Shm,
    /// RDMA queue pairs (tcp control); needs FERRY_TEST_RDMA=1 and a NIC.
    Verbs,
}

impl Path {
    pub fn io(self) -> IoPreference {
        match self {
            Path::TcpUring => IoPreference::Uring,
            Path::TcpEpoll | Path::Verbs => IoPreference::Epoll,
            Path::Shm => IoPreference::Auto,
        }
    }

    pub fn transport(self) -> Transport {
        match self {
            Path::Shm => Transport::Shm,
            _ => Transport::Tcp,
        }
    }

    pub fn transport_name(self) -> &'static str {
        match self {
            Path::Shm => "shm",
            Path::Verbs => "verbs",
            _ => "tcp",
        }
    }

    /// Fails the calling test, saying why, where this path cannot run
    /// here (the verbs arms are `#[ignore]`d, so this fires only when they
    /// were asked for).
    pub fn require(self) {
        if self == Path::Verbs {
            if std::env::var("FERRY_TEST_RDMA").as_deref() != Ok("1") {
                panic!("the verbs path needs FERRY_TEST_RDMA=1 and an RDMA NIC");
            }
            if let Err(why) = ferry::verbs::status(None, None) {
                panic!("FERRY_TEST_RDMA=1 but verbs is off here: {why}");
            }
        }
        require_backend(self.io())
    }
}

pub fn path_config(path: Path) -> Config {
    {
        let mut conf = config(path.io());
        conf.transport = path.transport();
        conf
    }
}

pub fn path_client(path: Path) -> Endpoint {
    Endpoint::builder()
        .config(path_config(path))
        .build()
        .expect("client endpoint")
}

/// Endpoints in these tests talk tcp unless a test asks for shared memory.
pub fn config(io: IoPreference) -> Config {
    {
        let mut conf = Config::default();
        conf.listen_addr = "127.0.0.1".parse().unwrap();
        conf.transport = Transport::Tcp;
        conf.io = io;
        conf.op_timeout_ms = 5000;
        conf.connect_timeout_ms = 3000;
        conf
    }
}

pub fn client(io: IoPreference) -> Endpoint {
    Endpoint::builder()
        .config(config(io))
        .build()
        .expect("client endpoint")
}

pub fn embedded(io: IoPreference) -> Endpoint {
    Endpoint::builder()
        .config({
            let mut conf = config(io);
            conf.mode = Mode::Embedded;
            conf
        })
        .build()
        .expect("embedded endpoint")
}

/// The `ferry` binary: `FERRY_BIN` when set (test binaries carried to
/// another machine, where cargo's build path does not exist), else cargo's.
pub fn ferry_bin() -> String {
    std::env::var("FERRY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferry").to_owned())
}

/// A `ferry serve` process; killed when dropped.
pub struct Target {
    pub child: Child,
    pub served: Served,
}

impl Target {
    pub fn start(io: IoPreference, bytes: usize, env: &[(&str, &str)]) -> Target {
        Self::start_on(
            if io == IoPreference::Uring {
                Path::TcpUring
            } else {
                Path::TcpEpoll
            },
            bytes,
            env,
        )
    }

    pub fn start_on(path: Path, bytes: usize, env: &[(&str, &str)]) -> Target {
        Self::start_with(path, bytes, env, &[])
    }

    /// `ferry serve` with extra flags (e.g. `--gpu 1`).
    pub fn start_with(path: Path, bytes: usize, env: &[(&str, &str)], args: &[&str]) -> Target {
        let mut cmd = Command::new(ferry_bin());
        cmd.args(["serve", "--bytes", &bytes.to_string()])
            .args(args)
            .env("FERRY_IO", io_name(path.io()))
            .env("FERRY_TRANSPORT", "auto")
            .env("FERRY_LOG", "error")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn ferry serve");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let served = read_served(&mut out).expect("ferry serve output");
        Target { child, served }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends a text request to `ferry serve` and waits for its answer.
pub fn ask(ep: &Endpoint, conn: ConnId, req: &str) -> String {
    ep.send_notification(conn, req.as_bytes())
        .expect("send notification");
    let (from, msg) = ep
        .recv_notification(Duration::from_secs(10))
        .expect("notification reply");
    assert_eq!(from, conn);
    String::from_utf8(msg).unwrap()
}

/// The target's hash of its bytes [off, off + len).
pub fn remote_hash(ep: &Endpoint, conn: ConnId, off: usize, len: usize) -> u64 {
    let a = ask(ep, conn, &format!("hash {off} {len}"));
    let h = a
        .strip_prefix("hash ")
        .unwrap_or_else(|| panic!("bad answer {a:?}"));
    u64::from_str_radix(h, 16).unwrap()
}

#[allow(unused_imports)] // not every suite measures memory
pub use ferry_cli::testkit::rss_kib;

/// Reads one control frame from a blocking socket (a raw peer's side of
/// the handshake).
pub fn read_control_frame(s: &mut impl std::io::Read) -> ferry::wire::ControlFrame {
    use ferry::wire::{ControlFrame, CONTROL_HEADER_LEN};
    let mut header = [0u8; CONTROL_HEADER_LEN];
    s.read_exact(&mut header).unwrap();
    let mut frame = vec![0u8; CONTROL_HEADER_LEN + ControlFrame::body_len(&header).unwrap()];
    frame[..CONTROL_HEADER_LEN].copy_from_slice(&header);
    s.read_exact(&mut frame[CONTROL_HEADER_LEN..]).unwrap();
    ControlFrame::decode(&frame).unwrap()
}

/// A raw peer: listens on 127.0.0.1, accepts one stream, answers its Hello
/// with a HelloAck declaring `max_inflight`, then hands the socket to
/// `then` (on its own thread). Returns the address and the thread.
pub fn raw_peer(
    max_inflight: u32,
    then: impl FnOnce(std::net::TcpStream) + Send + 'static,
) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    use ferry::wire::{ControlFrame, Hello};
    use std::io::Write;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let ControlFrame::Hello(h) = read_control_frame(&mut s) else {
            panic!("no hello")
        };
        let ack = Hello {
            endpoint_id: 7,
            max_inflight,
            ..h
        };
        s.write_all(&ControlFrame::HelloAck(ack).encode()).unwrap();
        then(s)
    });
    (addr, t)
}

/// Device 0's primary context made current in this thread (ferry retains
/// it; the test's own driver calls run in it).
pub fn primary_context_current() {
    use cudarc::driver::sys as cu;
    let dev = &ferry::gpu::cuda().unwrap().devices[0];
    // SAFETY: plain driver calls on device 0's primary context.
    unsafe {
        let mut d: cu::CUdevice = 0;
        assert_eq!(
            cu::cuDeviceGet(&mut d, dev.ordinal),
            cu::CUresult::CUDA_SUCCESS
        );
        let mut ctx = std::ptr::null_mut();
        assert_eq!(
            cu::cuDevicePrimaryCtxRetain(&mut ctx, d),
            cu::CUresult::CUDA_SUCCESS
        );
        assert_eq!(cu::cuCtxSetCurrent(ctx), cu::CUresult::CUDA_SUCCESS);
    }
}
