//! etcd's v3 API through its JSON gateway (`/v3/...`): leases, puts,
//! prefix ranges and deletes, and watches. Keys and values travel base64
//! encoded; int64 fields come as strings. Everything the server sends is
//! checked: a reply that does not parse is an error naming the call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use super::http::{self, HttpError, Messages, Response, Target};

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The HTTP exchange failed (connect, deadline, a malformed answer).
    #[error(transparent)]
    Http(#[from] HttpError),
    /// etcd answered with an error, or with JSON we could not read.
    #[error("etcd {call}: {why}")]
    Reply {
        /// The call ("put", "range", "lease grant", …).
        call: &'static str,
        /// What etcd said, or what was wrong with its answer.
        why: String,
    },
}

type R<T> = Result<T, EtcdError>;

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (how the v3 JSON gateway carries bytes).
pub fn b64(data: &[u8]) -> String {
    let mut o = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for k in 0..4 {
            if k <= c.len() {
                o.push(B64[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                o.push('=');
            }
        }
    }
    o
}

/// Decodes standard base64 (padding optional); `None` for anything else.
pub fn unb64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for ch in s.bytes() {
        let v = B64.iter().position(|&c| c == ch)? as u32;
        acc = acc << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// The key just past every key that starts with `prefix` (etcd's
/// `range_end` for a prefix).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut e = prefix.to_vec();
    while let Some(last) = e.pop() {
        if last < 0xff {
            e.push(last + 1);
            return e;
        }
    }
    vec![0]
}

/// One stored key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// Its value (empty from a keys-only range).
    pub value: Vec<u8>,
    /// The lease it is attached to (0: none).
    pub lease: i64,
    /// The revision of its last change.
    pub mod_revision: i64,
}

/// A watch event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The key was written.
    Put(Kv),
    /// The key was deleted.
    Delete(Vec<u8>),
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn kv(v: &Value) -> Option<Kv> {
    Some(Kv {
        key: unb64(v.get("key")?.as_str()?)?,
        value: v
            .get("value")
            .and_then(Value::as_str)
            .map_or(Some(Vec::new()), unb64)?,
        lease: v.get("lease").and_then(int).unwrap_or(0),
        mod_revision: v.get("mod_revision").and_then(int).unwrap_or(0),
    })
}

/// A client of one etcd member's gateway.
#[derive(Debug, Clone)]
pub struct Etcd {
    /// The member's client address, and TLS to it.
    pub(crate) to: Target,
    /// Each call's deadline.
    pub timeout: Duration,
    /// etcd's user authentication, when it has it on.
    pub(crate) auth: Option<Arc<Auth>>,
}

/// A user's credentials and the token they got (shared by the clones of
/// one client: the lease keeper's and the caller's).
pub(crate) struct Auth {
    pub user: String,
    pub password: String,
    pub token: Mutex<Option<String>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Whether etcd refused a call for its token (expired, or revoked by a
/// restart): fetched again once, then the call is retried.
fn token_refused(e: &EtcdError) -> bool {
    let text = e.to_string();
    text.contains("invalid auth token") || text.contains("token is expired")
}

/// Whether a TLS alert says the server refused our client certificate.
fn refused_cert(e: &std::io::Error) -> bool {
    let text = e.to_string();
    text.contains("BadCertificate") || text.contains("CertificateRequired")
}

impl Etcd {
    /// A client of the member at `to`, authenticating as `auth` when given.
    pub(crate) fn new(to: Target, timeout: Duration, auth: Option<(String, String)>) -> Etcd {
        Etcd {
            to,
            timeout,
            auth: auth.map(|(user, password)| {
                Arc::new(Auth {
                    user,
                    password,
                    token: Mutex::new(None),
                })
            }),
        }
    }

    /// The token to send: none without authentication, else the one we
    /// hold, fetched first if we hold none.
    fn token(&self) -> R<Option<String>> {
        let Some(a) = &self.auth else { return Ok(None) };
        if let Some(t) = a.token.lock().expect("lock").clone() {
            return Ok(Some(t));
        }
        let body = json!({ "name": a.user, "password": a.password });
        let v = self.call_with(
            "authenticate",
            "/v3/auth/authenticate",
            &body,
            None,
            64 << 10,
        )?;
        let t = v
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| EtcdError::Reply {
                call: "authenticate",
                why: "no token in the answer".into(),
            })?
            .to_owned();
        *a.token.lock().expect("lock") = Some(t.clone());
        Ok(Some(t))
    }

    /// Forgets a token etcd refused.
    fn drop_token(&self) {
        if let Some(a) = &self.auth {
            *a.token.lock().expect("lock") = None;
        }
    }

    fn call(&self, call: &'static str, path: &str, body: Value) -> R<Value> {
        self.call_capped(call, path, body, http::MAX_BODY)
    }

    /// `call`, refusing an answer over `cap` bytes; with authentication,
    /// a refused token is fetched again once.
    fn call_capped(&self, call: &'static str, path: &str, body: Value, cap: usize) -> R<Value> {
        let token = self.token()?;
        match self.call_with(call, path, &body, token.as_deref(), cap) {
            Err(e) if self.auth.is_some() && token_refused(&e) => {
                self.drop_token();
                let token = self.token()?;
                self.call_with(call, path, &body, token.as_deref(), cap)
            }
            other => other,
        }
    }

    fn call_with(
        &self,
        call: &'static str,
        path: &str,
        body: &Value,
        token: Option<&str>,
        cap: usize,
    ) -> R<Value> {
        let bytes = body.to_string();
        let mut resp = http::post(&self.to, path, bytes.as_bytes(), self.timeout, token).map_err(
            |e| match e {
                // etcd's gateway answers a refused call with a status and
                // a JSON body that says why: the call's error, not HTTP's.
                HttpError::Status { body, .. } if body.starts_with('{') => {
                    EtcdError::Reply { call, why: body }
                }
                HttpError::Io { ref source, .. } if refused_cert(source) => EtcdError::Reply {
                    call,
                    why: format!(
                        "{e} (etcd refused our client certificate: none was sent, or its \
                         CA is not one etcd trusts; FERRY_ETCD_CERT/KEY, --etcd-cert/--etcd-key)"
                    ),
                },
                e => EtcdError::Http(e),
            },
        )?;
        resp.limit(cap);
        let bytes = resp.read_all()?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| EtcdError::Reply {
            call,
            why: format!("not JSON ({e})"),
        })?;
        if let Some(err) = v.get("error").or_else(|| v.get("message")) {
            return Err(EtcdError::Reply {
                call,
                why: err.to_string(),
            });
        }
        Ok(v)
    }

    /// A lease of `ttl_s` seconds; its id.
    pub fn grant(&self, ttl_s: u64) -> R<i64> {
        let v = self.call("lease grant", "/v3/lease/grant", json!({ "TTL": ttl_s }))?;
        v.get("ID").and_then(int).ok_or_else(|| EtcdError::Reply {
            call: "lease grant",
            why: format!("no lease id in {v}"),
        })
    }

    /// Renews lease `id`; its remaining TTL (0 or less: it has expired).
    pub fn keepalive(&self, id: i64) -> R<i64> {
        let v = self.call(
            "lease keepalive",
            "/v3/lease/keepalive",
            json!({ "ID": id.to_string() }),
        )?;
        let r = v.get("result").unwrap_or(&v);
        Ok(r.get("TTL").and_then(int).unwrap_or(0))
    }

    /// (Seconds lease `id` has left, seconds it was granted); the first is
    /// 0 or less once it expired (or for an unknown lease).
    pub fn time_to_live(&self, id: i64) -> R<(i64, i64)> {
        let v = self.call(
            "lease timetolive",
            "/v3/lease/timetolive",
            json!({ "ID": id.to_string() }),
        )?;
        let left = v.get("TTL").and_then(int).unwrap_or(0);
        Ok((left, v.get("grantedTTL").and_then(int).unwrap_or(0)))
    }

    /// Revokes lease `id` (its keys go with it).
    pub fn revoke(&self, id: i64) -> R<()> {
        self.call(
            "lease revoke",
            "/v3/lease/revoke",
            json!({ "ID": id.to_string() }),
        )
        .map(|_| ())
    }

    /// Writes `key` = `value`, attached to `lease` (0: none).
    pub fn put(&self, key: &[u8], value: &[u8], lease: i64) -> R<()> {
        let mut body = json!({ "key": b64(key), "value": b64(value) });
        if lease != 0 {
            body["lease"] = json!(lease.to_string());
        }
        self.call("put", "/v3/kv/put", body).map(|_| ())
    }

    /// Puts `value` at `key` only if no key is there (an etcd transaction
    /// comparing its create revision with 0); `false`, writing nothing,
    /// when one is.
    pub fn create(&self, key: &[u8], value: &[u8], lease: i64) -> R<bool> {
        let mut put = json!({ "key": b64(key), "value": b64(value) });
        if lease != 0 {
            put["lease"] = json!(lease.to_string());
        }
        let body = json!({
            "compare": [{
                "key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"
            }],
            "success": [{ "request_put": put }],
        });
        let v = self.call("txn", "/v3/kv/txn", body)?;
        // The gateway leaves out a false "succeeded".
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    /// The value at exactly `key`, if there is one.
    pub fn get(&self, key: &[u8]) -> R<Option<Kv>> {
        let v = self.call("range", "/v3/kv/range", json!({ "key": b64(key) }))?;
        let Some(k) = v
            .get("kvs")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
        else {
            return Ok(None);
        };
        kv(k).map(Some).ok_or_else(|| EtcdError::Reply {
            call: "range",
            why: format!("bad key-value {k}"),
        })
    }

    /// Every key under `prefix` (no values), in key order, read one page
    /// of `page` keys at a time; at most `max_bytes` of keys in all (past
    /// that `more` is true: whoever writes the keys does not size our
    /// memory).
    pub fn keys(&self, prefix: &[u8], page: usize, max_bytes: usize) -> R<(Vec<Vec<u8>>, bool)> {
        let end = prefix_end(prefix);
        let mut from = prefix.to_vec();
        let mut out = Vec::new();
        let mut bytes = 0usize;
        loop {
            let body = json!({
                "key": b64(&from),
                "range_end": b64(&end),
                "keys_only": true,
                "limit": page,
            });
            let v = self.call("range", "/v3/kv/range", body)?;
            let kvs = v.get("kvs").and_then(Value::as_array);
            for k in kvs.into_iter().flatten() {
                let key = k
                    .get("key")
                    .and_then(Value::as_str)
                    .and_then(unb64)
                    .ok_or_else(|| EtcdError::Reply {
                        call: "range",
                        why: format!("bad key {k}"),
                    })?;
                bytes += key.len();
                out.push(key);
            }
            let more = v.get("more").and_then(Value::as_bool).unwrap_or(false);
            if !more || bytes >= max_bytes {
                return Ok((out, more));
            }
            // The next page starts just past the last key.
            from = out.last().cloned().unwrap_or_default();
            from.push(0);
        }
    }

    /// Every key under `prefix` with its value, refused as a whole when
    /// the answer is over `cap` bytes (one record's bound).
    pub fn range_prefix_capped(&self, prefix: &[u8], cap: usize) -> R<Vec<Kv>> {
        let body = json!({ "key": b64(prefix), "range_end": b64(&prefix_end(prefix)) });
        let v = self.call_capped("range", "/v3/kv/range", body, cap)?;
        let kvs = v.get("kvs").and_then(Value::as_array);
        kvs.into_iter()
            .flatten()
            .map(|k| {
                kv(k).ok_or_else(|| EtcdError::Reply {
                    call: "range",
                    why: format!("bad key-value {k}"),
                })
            })
            .collect()
    }

    /// Deletes every key under `prefix`.
    pub fn delete_prefix(&self, prefix: &[u8]) -> R<()> {
        let body = json!({ "key": b64(prefix), "range_end": b64(&prefix_end(prefix)) });
        self.call("delete", "/v3/kv/deleterange", body).map(|_| ())
    }

    /// Watches every key under `prefix` from now on.
    pub fn watch(&self, prefix: &[u8]) -> R<Watch> {
        let body = json!({ "create_request": {
            "key": b64(prefix), "range_end": b64(&prefix_end(prefix)) } });
        let token = self.token()?;
        let resp = http::post(
            &self.to,
            "/v3/watch",
            body.to_string().as_bytes(),
            self.timeout,
            token.as_deref(),
        )?;
        Ok(Watch {
            resp,
            msgs: Messages::default(),
        })
    }
}

/// An open watch: `next` returns the changes of each message.
pub struct Watch {
    resp: Response,
    msgs: Messages,
}

impl Watch {
    /// The next batch of changes, waiting at most `wait`; `Ok(None)` when
    /// nothing came in time, `Err` when the stream ended or broke.
    pub fn next(&mut self, wait: Duration) -> R<Option<Vec<Change>>> {
        loop {
            if let Some(m) = self.msgs.next() {
                let v: Value = serde_json::from_slice(&m).map_err(|e| EtcdError::Reply {
                    call: "watch",
                    why: format!("not JSON ({e})"),
                })?;
                let r = v.get("result").unwrap_or(&v);
                if r.get("canceled").and_then(Value::as_bool) == Some(true) {
                    return Err(EtcdError::Reply {
                        call: "watch",
                        why: format!("canceled by the server: {r}"),
                    });
                }
                let Some(events) = r.get("events").and_then(Value::as_array) else {
                    continue; // the "created" message, or progress
                };
                let mut out = Vec::with_capacity(events.len());
                for e in events {
                    let Some(k) = e.get("kv").and_then(kv) else {
                        continue;
                    };
                    out.push(match e.get("type").and_then(Value::as_str) {
                        Some("DELETE") => Change::Delete(k.key),
                        _ => Change::Put(k),
                    });
                }
                return Ok(Some(out));
            }
            self.resp.set_read_timeout(wait);
            match self.resp.next_piece() {
                Ok(Some(p)) => self
                    .msgs
                    .push(&p)
                    .map_err(|why| EtcdError::Reply { call: "watch", why })?,
                Ok(None) => {
                    return Err(EtcdError::Reply {
                        call: "watch",
                        why: "the stream ended".into(),
                    })
                }
                Err(HttpError::Io { source, .. })
                    if matches!(
                        source.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_the_standard() {
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(b64(b""), "");
        assert_eq!(b64(&[0xff, 0xfe]), "//4=");
        for n in 0..40u8 {
            let d: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
            assert_eq!(unb64(&b64(&d)).unwrap(), d);
        }
        assert_eq!(unb64("Zm9v!"), None);
    }

    #[test]
    fn prefix_ends_cover_exactly_the_prefix() {
        assert_eq!(prefix_end(b"ferry/a/"), b"ferry/a0");
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b");
        assert_eq!(prefix_end(&[0xff]), vec![0]);
    }
}
