use super::*;

#[test]
fn names_and_urls_are_checked() {
    assert!(check_name("name", "gpu-node_7.a").is_ok());
    for bad in ["", "a/b", "a b", &"x".repeat(129)] {
        assert!(check_name("name", bad).is_err(), "{bad:?}");
    }
    assert_eq!(parse_url("http://127.0.0.1:2379").unwrap().port(), 2379);
    assert_eq!(parse_url("127.0.0.1:2379/").unwrap().port(), 2379);
    assert_eq!(parse_url("https://127.0.0.1:2379").unwrap().port(), 2379);
    let no_ca = EtcdSecurity::default();
    let e = target("https://127.0.0.1:2379", &no_ca)
        .unwrap_err()
        .to_string();
    assert!(e.contains("https needs the CA"), "{e}");
    let with_ca = EtcdSecurity {
        ca: Some("/nonexistent/ca.pem".into()),
        ..Default::default()
    };
    let e = target("http://127.0.0.1:2379", &with_ca)
        .unwrap_err()
        .to_string();
    assert!(e.contains("plain http is refused"), "{e}");
    let e = target("https://127.0.0.1:2379", &with_ca)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("etcd CA") && e.contains("/nonexistent/ca.pem"),
        "{e}"
    );
    let half = EtcdSecurity {
        user: Some("u".into()),
        ..Default::default()
    };
    assert!(half.credentials().is_err());
    assert!(parse_url("http://127.0.0.1").is_err());
    assert_eq!(unhex(&hex(&[0, 1, 0xab])).unwrap(), vec![0, 1, 0xab]);
    assert_eq!(unhex("abc"), None);
}
