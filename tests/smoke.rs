use std::time::Duration;

use ferry::{Config, Endpoint};

fn ep() -> Endpoint {
    let cfg = Config { listen_addr: "127.0.0.1".parse().unwrap(), ..Config::default() };
    Endpoint::builder().config(cfg).build().unwrap()
}

#[test]
fn write_then_read_in_process() {
    let a = ep();
    let b = ep();
    let meta = b.metadata_bytes();
    let t = std::thread::spawn(move || {
        let (c, _) = b.accept(Duration::from_secs(5)).unwrap();
        (b, c)
    });
    let conn = a.add_remote(&meta).unwrap();
    let (b, _bc) = t.join().unwrap();
    let target = b.alloc(1 << 20).unwrap();
    let rb = target.advertise(0, 1 << 20).unwrap();
    let src = a.register((0..1 << 20).map(|i| i as u8).collect::<Vec<u8>>()).unwrap();
    a.write(conn, &src, 0, 1 << 20, &rb).unwrap();
    let mut got = vec![0u8; 1 << 20];
    target.read_at(0, &mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &x)| x == i as u8));
    let dst = a.alloc(1 << 20).unwrap();
    a.read(conn, &dst, 0, 1 << 20, &rb).unwrap();
    dst.read_at(0, &mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &x)| x == i as u8));
}
