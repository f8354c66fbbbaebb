//! The directory against a production-shaped etcd: TLS with client
//! certificates (`--client-cert-auth`) and user authentication on, a
//! least-privilege role for ferry's prefix. The certificates are made here
//! (openssl, a test CA of this run), the users and roles with `etcdctl`
//! (Debian's etcd-client; `.ci/run` installs it).
//! Run: `cargo test -p ferry-cli --features directory --test directory_tls`.
#![cfg(feature = "directory")]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::directory::{Directory, EtcdSecurity};
use ferry::{Config, Endpoint};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and certificates it signed, in a directory of this test.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn path(&self, f: &str) -> PathBuf {
        self.dir.join(f)
    }

    /// A self-signed CA `name` (name.pem, name.key).
    fn ca(&self, name: &str) {
        run(Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
            .args(["-subj", &format!("/CN=ferry test {name}")])
            .args(["-addext", "basicConstraints=critical,CA:TRUE"])
            .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
            .arg("-keyout")
            .arg(self.path(&format!("{name}.key")))
            .arg("-out")
            .arg(self.path(&format!("{name}.pem"))));
    }

    /// A certificate `name` signed by CA `ca`, for `usage` (serverAuth,
    /// clientAuth), with an IP 127.0.0.1 name.
    fn leaf(&self, name: &str, ca: &str, usage: &str) {
        let (key, csr, pem, ext) = (
            self.path(&format!("{name}.key")),
            self.path(&format!("{name}.csr")),
            self.path(&format!("{name}.pem")),
            self.path(&format!("{name}.ext")),
        );
        std::fs::write(
            &ext,
            format!("subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"),
        )
        .unwrap();
        run(Command::new("openssl")
            .args([
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ])
            // No CommonName: etcd's JSON gateway refuses (400) a client
            // certificate that carries one while auth is on (the CN would
            // be a user name the gateway cannot pass on).
            .args(["-nodes", "-subj", &format!("/O=ferry test/OU={name}")])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&csr));
        run(Command::new("openssl")
            .args(["x509", "-req", "-days", "1", "-in"])
            .arg(&csr)
            .arg("-CA")
            .arg(self.path(&format!("{ca}.pem")))
            .arg("-CAkey")
            .arg(self.path(&format!("{ca}.key")))
            .args(["-CAcreateserial", "-out"])
            .arg(&pem)
            .arg("-extfile")
            .arg(&ext));
    }
}

struct Etcd {
    child: Child,
    url: String,
    dir: PathBuf,
    pki: Pki,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Etcd {
    /// etcdctl as root, over TLS with the client certificate.
    fn ctl(&self, args: &[&str], root: bool) {
        let mut c = Command::new("etcdctl");
        c.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.url))
            .arg(format!("--cacert={}", self.pki.path("ca.pem").display()))
            .arg(format!("--cert={}", self.pki.path("client.pem").display()))
            .arg(format!("--key={}", self.pki.path("client.key").display()));
        if root {
            c.arg("--user=root:rootpw");
        }
        run(c.args(args));
    }

    fn security(&self, user: &str, password: &str) -> EtcdSecurity {
        EtcdSecurity {
            ca: Some(self.pki.path("ca.pem")),
            cert: Some(self.pki.path("client.pem")),
            key: Some(self.pki.path("client.key")),
            user: Some(user.into()),
            password: Some(password.into()),
        }
    }
}

/// etcd on free ports with TLS, client certificates and auth on; users
/// `ferry` (read-write under `ferry/` only) and `other` (under `other/`).
fn etcd() -> Etcd {
    let (client, peer) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("ferry-etcd-tls-{}-{client}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pki = Pki {
        dir: dir.join("pki"),
    };
    std::fs::create_dir_all(&pki.dir).unwrap();
    pki.ca("ca");
    pki.ca("other-ca");
    // etcd's JSON gateway dials its own gRPC server with this one too.
    pki.leaf("server", "ca", "serverAuth,clientAuth");
    pki.leaf("client", "ca", "clientAuth");
    let url = format!("https://127.0.0.1:{client}");
    let child = Command::new("etcd")
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args([
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
        ])
        .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .args([
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
        ])
        .args([
            "--initial-cluster",
            &format!("default=http://127.0.0.1:{peer}"),
        ])
        .arg("--cert-file")
        .arg(pki.path("server.pem"))
        .arg("--key-file")
        .arg(pki.path("server.key"))
        .arg("--trusted-ca-file")
        .arg(pki.path("ca.pem"))
        .arg("--client-cert-auth")
        // Tokens that expire after a second unused: a client must fetch
        // a new one (tested at the end).
        .arg("--auth-token-ttl=1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd not found: install Debian's etcd-server (.ci/run does)");
    let e = Etcd {
        child,
        url,
        dir,
        pki,
    };
    let t0 = Instant::now();
    let probe = EtcdSecurity {
        user: None,
        password: None,
        ..e.security("", "")
    };
    let d = Directory::with_security(&e.url, "probe", &probe).unwrap();
    while let Err(err) = d.list() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "etcd did not come up: {err}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    add_users(&e);
    e.ctl(&["auth", "enable"], false);
    e
}

/// root, and a user with a role of read-write under one prefix for each
/// of `ferry/` and `other/`.
fn add_users(e: &Etcd) {
    e.ctl(
        &["user", "add", "root", "--new-user-password=rootpw"],
        false,
    );
    e.ctl(&["role", "add", "ferry-rw"], false);
    e.ctl(
        &[
            "role",
            "grant-permission",
            "ferry-rw",
            "--prefix=true",
            "readwrite",
            "ferry/",
        ],
        false,
    );
    e.ctl(
        &["user", "add", "ferry", "--new-user-password=ferrypw"],
        false,
    );
    e.ctl(&["user", "grant-role", "ferry", "ferry-rw"], false);
    e.ctl(&["role", "add", "other-rw"], false);
    e.ctl(
        &[
            "role",
            "grant-permission",
            "other-rw",
            "--prefix=true",
            "readwrite",
            "other/",
        ],
        false,
    );
    e.ctl(
        &["user", "add", "other", "--new-user-password=otherpw"],
        false,
    );
    e.ctl(&["user", "grant-role", "other", "other-rw"], false);
}

fn endpoint() -> Endpoint {
    let mut cfg = Config::default();
    cfg.listen_addr = "127.0.0.1".parse().unwrap();
    let ep = Endpoint::builder().config(cfg).build().unwrap();
    ep.start_passive_accept().unwrap();
    ep
}

fn publish_error(e: &Etcd, sec: &EtcdSecurity) -> String {
    let d = Directory::with_security(&e.url, "tls", sec).unwrap();
    match d.publish(&endpoint(), "nope", Duration::from_secs(5)) {
        Ok(_) => panic!("published with {sec:?}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn tls_and_auth_publish_list_and_look_up_and_refuse_the_wrong_ones() {
    let e = etcd();
    let sec = e.security("ferry", "ferrypw");
    let dir = Directory::with_security(&e.url, "tls", &sec).unwrap();
    let target = endpoint();
    let dst = target.alloc(4096).unwrap();
    let pubn = dir.publish(&target, "a", Duration::from_secs(5)).unwrap();
    pubn.add_window("kv", &dst.advertise(0, 4096).unwrap().encode())
        .unwrap();
    let listed = dir.list().unwrap();
    assert_eq!(
        listed.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(),
        ["a"]
    );
    let initiator = endpoint();
    let conn = dir.connect_by_name(&initiator, "a").unwrap();
    let win = ferry::RemoteBuf::decode(&dir.window("a", "kv").unwrap()).unwrap();
    let src = initiator.register(b"over tls".to_vec()).unwrap();
    initiator.write(conn, &src, 0, 8, &win).unwrap();
    let mut got = [0u8; 8];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"over tls");

    // Each wrong setting fails, saying what.
    let wrong_ca = EtcdSecurity {
        ca: Some(e.pki.path("other-ca.pem")),
        ..sec.clone()
    };
    let err = publish_error(&e, &wrong_ca);
    assert!(
        err.contains("TLS handshake") && err.contains("certificate"),
        "{err}"
    );
    let no_cert = EtcdSecurity {
        cert: None,
        key: None,
        ..sec.clone()
    };
    let err = publish_error(&e, &no_cert);
    assert!(err.contains("refused our client certificate"), "{err}");
    let wrong_password = e.security("ferry", "guess");
    let err = publish_error(&e, &wrong_password);
    assert!(
        err.contains("authenticate") && err.contains("invalid user ID or password"),
        "{err}"
    );
    let other_prefix = e.security("other", "otherpw");
    let err = publish_error(&e, &other_prefix);
    assert!(err.contains("permission denied"), "{err}");
    println!("wrong CA: {}", publish_error(&e, &wrong_ca));
    println!("no client certificate: {}", publish_error(&e, &no_cert));
    println!(
        "wrong password: {err}",
        err = publish_error(&e, &wrong_password)
    );
    println!(
        "another prefix's user: {}",
        publish_error(&e, &other_prefix)
    );

    // The command-line tool: serve publishes, ls lists, bench measures,
    // with the flags and the user from the environment.
    cli_round(&e);
    pubn.close();

    // A token unused past its TTL is refused ("invalid auth token"): the
    // client authenticates again and the call goes through.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(dir.list().unwrap().iter().all(|x| x.name != "a"), "closed");
}

fn ferry_cmd(e: &Etcd, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.args(args)
        .arg("--etcd-ca")
        .arg(e.pki.path("ca.pem"))
        .arg("--etcd-cert")
        .arg(e.pki.path("client.pem"))
        .arg(format!("--etcd-key={}", e.pki.path("client.key").display()))
        .env("FERRY_ETCD_USER", "ferry")
        .env("FERRY_ETCD_PASSWORD", "ferrypw")
        .env("FERRY_LOG", "error");
    c
}

fn cli_round(e: &Etcd) {
    let mut serve = ferry_cmd(e, &["serve", "--bytes", "1048576"])
        .args(["--directory", &e.url, "--cluster", "tls", "--name", "cli-a"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(serve.stdout.take().unwrap());
    let served = ferry_cli::testkit::read_served(&mut out);
    let r = (|| {
        served?;
        let ls = ferry_cmd(e, &["ls", "--directory", &e.url, "--cluster", "tls"])
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&ls.stdout).to_string();
        if !ls.status.success() || !text.contains("cli-a") {
            return Err(format!("ls: {text}{}", String::from_utf8_lossy(&ls.stderr)));
        }
        let bench = ferry_cmd(e, &["bench", "--directory", &e.url, "--cluster", "tls"])
            .args(["--peer", "cli-a", "--sizes", "4K", "--seconds", "0.2"])
            .output()
            .map_err(|e| e.to_string())?;
        if !bench.status.success() {
            return Err(format!("bench: {}", String::from_utf8_lossy(&bench.stderr)));
        }
        // The same flags without the user: etcd refuses the publication.
        let anon = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["ls", "--directory", &e.url, "--cluster", "tls"])
            .arg(format!("--etcd-ca={}", e.pki.path("ca.pem").display()))
            .arg(format!(
                "--etcd-cert={}",
                e.pki.path("client.pem").display()
            ))
            .arg(format!("--etcd-key={}", e.pki.path("client.key").display()))
            .output()
            .map_err(|e| e.to_string())?;
        if anon.status.success() {
            return Err("ls without a user was allowed".into());
        }
        Ok(text)
    })();
    let _ = serve.kill();
    let _ = serve.wait();
    let text = r.unwrap();
    println!("ferry ls over TLS: {}", text.trim());
}
