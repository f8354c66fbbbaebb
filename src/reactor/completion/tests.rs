use super::*;
use crate::wire::Status;

#[test]
fn claim_complete_reap_free() {
    let t = CompletionTable::new(2);
    let mut a = t.claim().unwrap();
    let mut b = t.claim().unwrap();
    assert!(t.claim().is_none(), "capacity is a hard bound");
    assert!(a.poll().is_none());
    t.complete(a.slot(), Ok(()));
    assert!(matches!(a.poll(), Some(Ok(()))));
    assert!(
        matches!(a.poll(), Some(Ok(()))),
        "poll after completion repeats the outcome"
    );
    t.complete(
        b.slot(),
        Err(Error::Remote {
            op: crate::error::OpKind::Read,
            status: Status::UnknownKey,
            rkey: 1,
            addr: 2,
            len: 3,
        }),
    );
    assert!(matches!(
        b.wait_timeout(Duration::from_millis(1)),
        Err(Error::Remote { rkey: 1, .. })
    ));
    assert_eq!(t.in_use(), 0);
    drop((a, b));
    assert!(t.claim().is_some());
}

/// A split op ends once every part completed (from several threads),
/// with the error one part had; then the slot is reused unsplit.
#[test]
fn split_op_ends_with_its_last_part_and_keeps_an_error() {
    let t = CompletionTable::new(1);
    for round in 0..200u32 {
        let mut a = t.claim().unwrap();
        let idx = a.slot();
        t.set_parts(idx, 4);
        let bad = round % 5;
        let hs: Vec<_> = (0..4u32)
            .map(|p| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let outcome = if p == bad {
                        Err(Error::Timeout {
                            what: "part",
                            timeout_ms: u64::from(p),
                        })
                    } else {
                        Ok(())
                    };
                    assert!(t.complete(idx, outcome));
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        match a.poll() {
            Some(Ok(())) => assert_eq!(bad, 4, "round {round}: an error was lost"),
            Some(Err(Error::Timeout { timeout_ms, .. })) => {
                assert_eq!(timeout_ms, u64::from(bad))
            }
            other => panic!("round {round}: {other:?}"),
        }
        drop(a);
    }
    // Not done before the last part; a single op after it is unsplit.
    let mut a = t.claim().unwrap();
    t.set_parts(a.slot(), 2);
    t.complete(a.slot(), Ok(()));
    assert!(a.poll().is_none());
    t.complete(a.slot(), Ok(()));
    assert!(matches!(a.poll(), Some(Ok(()))));
    drop(a);
    let mut b = t.claim().unwrap();
    t.complete(b.slot(), Ok(()));
    assert!(matches!(b.poll(), Some(Ok(()))));
}

#[test]
fn dropped_transfer_frees_slot_on_completion() {
    let t = CompletionTable::new(1);
    let a = t.claim().unwrap();
    let idx = a.slot();
    drop(a);
    assert_eq!(t.in_use(), 1);
    t.complete(idx, Ok(()));
    assert_eq!(t.in_use(), 0);
}

#[test]
fn waiter_sleeps_and_is_woken_from_another_thread() {
    let t = CompletionTable::new(4);
    let mut a = t.claim().unwrap();
    let idx = a.slot();
    let t2 = t.clone();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        t2.complete(idx, Ok(()));
    });
    a.wait_timeout(Duration::from_secs(10)).unwrap();
    h.join().unwrap();
}

#[test]
fn wait_timeout_expires_and_transfer_stays_usable() {
    let t = CompletionTable::new(1);
    let mut a = t.claim().unwrap();
    assert!(matches!(
        a.wait_timeout(Duration::from_millis(20)),
        Err(Error::Timeout { .. })
    ));
    t.complete(a.slot(), Ok(()));
    a.wait_timeout(Duration::from_millis(20)).unwrap();
}

#[test]
fn a_second_completion_changes_nothing() {
    let t = CompletionTable::new(2);
    let mut a = t.claim().unwrap();
    assert!(t.complete(
        a.slot(),
        Err(Error::Unsupported {
            what: "first",
            reason: String::new(),
        })
    ));
    assert!(!t.complete(a.slot(), Ok(())), "second completion refused");
    assert!(a.poll().unwrap().is_err(), "the first outcome stands");
    // A free slot cannot be completed either.
    assert!(!t.complete(a.slot(), Ok(())));
}
