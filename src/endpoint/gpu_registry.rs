//! Which same-host endpoint serves which GPU, so that the seed's
//! `connect_local(gpu_bdf)` finds its peer: an endpoint with a GPU writes
//! `/dev/shm/ferry-gpu-u<uid>-<bus id>` (mode 0600: only this user's
//! processes read it) holding its endpoint id and pid, and removes it when
//! it closes. A reader trusts only a file owned by its own uid, private to
//! it, naming a live process. (The seed's same-host connect by GPU; every
//! face uses this one.)

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

const DIR: &str = "/dev/shm";

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

fn prefix() -> String {
    format!("ferry-gpu-u{}-", uid())
}

/// Why the registry could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Not a PCI bus id.
    #[error("{bus_id:?} is not a PCI bus id (like 0000:1b:00.0)")]
    BadBusId {
        /// What was given.
        bus_id: String,
    },
    /// The record file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The record's path.
        path: String,
        /// What the call said.
        error: std::io::Error,
    },
    /// The record is not a private file of this user: not trusted.
    #[error(
        "{path} is not a private file of uid {uid} (owner {owner}, mode {mode:o}); not trusted"
    )]
    Untrusted {
        /// The record's path.
        path: String,
        /// Our uid.
        uid: u32,
        /// The file's owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
    },
    /// The record's endpoint's process is gone.
    #[error("{path}: its endpoint's process {pid} is gone")]
    Gone {
        /// The record's path.
        path: String,
        /// The process it names.
        pid: u32,
    },
    /// The file does not hold an endpoint record.
    #[error("{path}: not an endpoint record")]
    NotARecord {
        /// The record's path.
        path: String,
    },
    /// Another live endpoint serves the GPU.
    #[error("GPU {bus_id} is already served by endpoint {other:016x} (pid {pid})")]
    Taken {
        /// The GPU.
        bus_id: String,
        /// The endpoint that serves it.
        other: u64,
        /// Its process.
        pid: u32,
    },
}

fn io_at(path: &str) -> impl Fn(std::io::Error) -> RegistryError + '_ {
    move |error| RegistryError::Io {
        path: path.to_owned(),
        error,
    }
}

fn path_of(bus_id: &str) -> Result<String, RegistryError> {
    let ok = !bus_id.is_empty()
        && bus_id.len() <= 32
        && bus_id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.');
    if !ok {
        return Err(RegistryError::BadBusId {
            bus_id: bus_id.to_owned(),
        });
    }
    Ok(format!("{DIR}/{}{}", prefix(), bus_id.to_ascii_lowercase()))
}

/// (endpoint id, pid) from a registry file we may trust.
fn read(path: &str) -> Result<(u64, u32), RegistryError> {
    let f = std::fs::File::open(path).map_err(io_at(path))?;
    let m = f.metadata().map_err(io_at(path))?;
    if m.uid() != uid() || m.mode() & 0o077 != 0 || !m.is_file() {
        return Err(RegistryError::Untrusted {
            path: path.to_owned(),
            uid: uid(),
            owner: m.uid(),
            mode: m.mode() & 0o777,
        });
    }
    let mut s = String::new();
    use std::io::Read;
    f.take(64).read_to_string(&mut s).map_err(io_at(path))?;
    let mut it = s.split_whitespace();
    let id = it.next().and_then(|v| u64::from_str_radix(v, 16).ok());
    let pid = it.next().and_then(|v| v.parse().ok());
    match (id, pid) {
        (Some(id), Some(pid)) if crate::sys::pid_alive(pid) => Ok((id, pid)),
        (Some(_), Some(pid)) => Err(RegistryError::Gone {
            path: path.to_owned(),
            pid,
        }),
        _ => Err(RegistryError::NotARecord {
            path: path.to_owned(),
        }),
    }
}

/// This endpoint's record; removed on drop if it is still ours.
#[derive(Debug)]
pub struct Published {
    path: String,
    id: u64,
}

impl Drop for Published {
    fn drop(&mut self) {
        if matches!(read(&self.path), Ok((id, _)) if id == self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Says that endpoint `id` of this process serves the GPU `bus_id`. A
/// record of a live other endpoint is not replaced.
pub fn publish(bus_id: &str, id: u64) -> Result<Published, RegistryError> {
    let path = path_of(bus_id)?;
    if let Ok((other, pid)) = read(&path) {
        if other != id {
            return Err(RegistryError::Taken {
                bus_id: bus_id.to_owned(),
                other,
                pid,
            });
        }
    }
    let tmp = format!("{path}.{}", std::process::id());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_at(&tmp))?;
    writeln!(f, "{id:016x} {}", std::process::id()).map_err(io_at(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_at(&path))?;
    Ok(Published { path, id })
}

/// The endpoint id serving GPU `bus_id` (any spelling) on this host, for
/// this user.
pub fn find(bus_id: &str) -> Result<u64, RegistryError> {
    read(&path_of(&crate::wire::normalize_bus_id(bus_id))?).map(|(id, _)| id)
}

/// The GPU bus id endpoint `id` published, if any.
pub fn bus_id_of(id: u64) -> Option<String> {
    let p = prefix();
    std::fs::read_dir(DIR).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        let bus = name.strip_prefix(&p)?;
        let path = format!("{DIR}/{name}");
        matches!(read(&path), Ok((i, _)) if i == id).then(|| bus.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_find_and_forget() {
        // A bus id no real GPU has, unique to this process.
        let bus = format!("00ff:{:02x}:1f.7", std::process::id() % 251);
        let id = 0xfeed_0000_0000_0000 | u64::from(std::process::id());
        let p = publish(&bus, id).unwrap();
        assert_eq!(find(&bus.to_ascii_uppercase()).unwrap(), id);
        assert_eq!(bus_id_of(id).as_deref(), Some(bus.as_str()));
        // A second endpoint may not take it while the first lives.
        assert!(publish(&bus, id + 1)
            .unwrap_err()
            .to_string()
            .contains("already served"));
        drop(p);
        assert!(find(&bus).is_err());
        assert!(find("not-a-bus")
            .unwrap_err()
            .to_string()
            .contains("not a PCI bus id"));
    }
}
