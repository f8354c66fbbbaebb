//! include/ferry.h is what cbindgen makes of capi/src now.

use std::path::Path;

#[test]
fn the_header_is_fresh() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut made = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses capi/src")
        .write(&mut made);
    let path = crate_dir.join("../include/ferry.h");
    if std::env::var_os("FERRY_BLESS").is_some() {
        std::fs::write(&path, &made).expect("write include/ferry.h");
    }
    let now = std::fs::read(&path).unwrap_or_default();
    assert!(
        now == made,
        "include/ferry.h is stale: run FERRY_BLESS=1 cargo test -p ferry-capi --test header"
    );
}
