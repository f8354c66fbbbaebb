//! The directory across hosts: etcd and a `ferry serve --directory` target
//! in one network namespace, a client in another finding it by name —
//! lookup, transfer, the target killed (its entries gone within the TTL,
//! `watch` says so), the target restarted (reached at its new
//! incarnation). Needs root (namespaces), etcd and a build with the
//! `directory` feature:
//! `cargo test -p ferry-cli --features directory --test directory -- --ignored`.
#![cfg(feature = "directory")]

mod common;

use std::io::BufReader;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::hosts::*;
use ferry::directory::{Directory, Event};
use ferry::{Config, Endpoint};
use ferry_cli::testkit::{check_pattern, read_served};

const URL: &str = "http://198.18.0.1:2379";

fn etcd_in(ns: &str, dir: &std::path::Path) -> Child {
    Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "etcd",
            "--data-dir",
            dir.to_str().unwrap(),
        ])
        .args(["--listen-client-urls", URL, "--advertise-client-urls", URL])
        .args(["--listen-peer-urls", "http://198.18.0.1:2380"])
        .args(["--initial-advertise-peer-urls", "http://198.18.0.1:2380"])
        .args(["--initial-cluster", "default=http://198.18.0.1:2380"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd (Debian's etcd-server)")
}

fn serve_named(ns: &str) -> Child {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_ferry"), "serve"])
        .args(["--listen", "198.18.0.1", "--bytes", "16777216"])
        .args(["--directory", URL, "--name", "kv-a", "--ttl", "2"])
        .env("FERRY_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    read_served(&mut out).expect("ferry serve --directory");
    child
}

fn read_all(ep: &Endpoint, dir: &Directory) -> Result<(), String> {
    let conn = dir.connect_by_name(ep, "kv-a").map_err(|e| e.to_string())?;
    let win = ferry::RemoteBuf::decode(&dir.window("kv-a", "main").map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let local = ep.alloc(1 << 20).map_err(|e| e.to_string())?;
    ep.read(conn, &local, 0, 1 << 20, &win)
        .map_err(|e| e.to_string())?;
    let mut got = vec![0u8; 1 << 20];
    local.read_at(0, &mut got).map_err(|e| e.to_string())?;
    match check_pattern(&got, 0, 0) {
        None => Ok(()),
        Some(at) => Err(format!("byte {at} differs")),
    }
}

#[test]
#[ignore = "needs root (network namespaces) and etcd: cargo test -p ferry-cli --features directory --test directory -- --ignored"]
fn found_by_name_across_hosts_through_death_and_restart() {
    let hosts = Hosts::make_as_root();
    let data = std::env::temp_dir().join(format!("ferry-etcd-ns-{}", std::process::id()));
    let mut etcd = etcd_in(&hosts.a, &data);
    let (a, b) = (hosts.a.clone(), hosts.b.clone());
    let r = std::thread::spawn(move || {
        enter(&b);
        let dir = Directory::new(URL, "ferry").unwrap();
        let t0 = Instant::now();
        while dir.list().is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "etcd did not come up"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut target = serve_named(&a);
        let mut cfg = Config::default();
        cfg.listen_addr = "198.18.0.2".parse().unwrap();
        cfg.op_timeout_ms = 2000;
        let ep = Endpoint::builder().config(cfg).build().unwrap();
        let first = dir.lookup("kv-a").unwrap();
        assert_eq!(first.addr.ip().to_string(), "198.18.0.1");
        read_all(&ep, &dir).unwrap();

        // Killed: no revoke; the lease (2 s) runs out.
        let mut watch = dir.watch("kv-a").unwrap();
        let killed = Instant::now();
        target.kill().unwrap();
        target.wait().unwrap();
        loop {
            assert!(killed.elapsed() < Duration::from_secs(10), "no Gone event");
            if watch.next(Duration::from_millis(200)).unwrap() == Some(Event::Gone) {
                break;
            }
        }
        let gone = killed.elapsed();
        assert!(dir.lookup("kv-a").is_err());

        // Restarted: a new incarnation, reached by name, never the old one.
        let mut again = serve_named(&a);
        let second = dir.lookup("kv-a").unwrap();
        assert_ne!(second.incarnation, first.incarnation);
        read_all(&ep, &dir).unwrap();
        let _ = again.kill();
        let _ = again.wait();
        gone
    })
    .join();
    let _ = etcd.kill();
    let _ = etcd.wait();
    let _ = std::fs::remove_dir_all(&data);
    drop(hosts);
    match r {
        Ok(gone) => println!("killed target's entries gone after {gone:?} (TTL 2 s)"),
        Err(p) => std::panic::resume_unwind(p),
    }
}
