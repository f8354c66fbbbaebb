//! The stage trace's shared page (built with `--features stage-trace`).
#![cfg(feature = "stage-trace")]

use ferry::stage_trace::{attach, get, mark, Stage};

#[test]
fn stamps_are_shared_through_the_named_file() {
    let path = std::env::temp_dir().join(format!("ferry-stage-test-{}", std::process::id()));
    attach(&path).unwrap();
    mark(Stage::RequestIn);
    let t = get(Stage::RequestIn);
    assert!(t > 0);
    let bytes = std::fs::read(&path).unwrap();
    let at = Stage::RequestIn as usize * 8;
    let word = u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap());
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        word, t,
        "the stamp is in the file, where another process sees it"
    );
}

#[test]
fn a_link_is_not_followed() {
    let dir = std::env::temp_dir();
    let target = dir.join(format!("ferry-stage-target-{}", std::process::id()));
    let link = dir.join(format!("ferry-stage-link-{}", std::process::id()));
    std::fs::write(&target, b"").unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let r = attach(&link);
    let len = std::fs::metadata(&target).unwrap().len();
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&target).unwrap();
    let e = r.expect_err("attached through a symbolic link");
    assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
    assert_eq!(len, 0, "the link's target was grown");
}
