use super::*;

#[test]
fn names_and_urls_are_checked() {
    assert!(check_name("name", "gpu-node_7.a").is_ok());
    for bad in ["", "a/b", "a b", &"x".repeat(129)] {
        assert!(check_name("name", bad).is_err(), "{bad:?}");
    }
    assert_eq!(parse_url("http://127.0.0.1:2379").unwrap().port(), 2379);
    assert_eq!(parse_url("127.0.0.1:2379/").unwrap().port(), 2379);
    assert!(parse_url("https://127.0.0.1:2379").is_err());
    assert!(parse_url("http://127.0.0.1").is_err());
    assert_eq!(unhex(&hex(&[0, 1, 0xab])).unwrap(), vec![0, 1, 0xab]);
    assert_eq!(unhex("abc"), None);
}
