//! Which RDMA NIC an endpoint uses: the one(s) nearest its GPU on the PCIe
//! tree, read from sysfs (the seed picks NICs by PCIe distance too), or the
//! ones `FERRY_RDMA_DEV` names. Pure file-system logic: tests run it on a
//! fake sysfs tree.

use std::path::{Path, PathBuf};

use crate::error::PathOff;

/// An RDMA device and where it sits on the PCIe tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// Its libibverbs name (`mlx5_0`).
    pub name: String,
    /// Canonical sysfs path of its PCI function
    /// (`/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0`).
    pub pci_path: PathBuf,
}

/// Every device under `<sysfs>/class/infiniband`, sorted by name. A missing
/// directory means no device (not an error).
pub fn list(sysfs: &Path) -> std::io::Result<Vec<Nic>> {
    let dir = sysfs.join("class/infiniband");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        // `device` links to the PCI function; a device without one (a
        // software device such as rxe on some kernels) has no PCIe place.
        let pci_path = std::fs::canonicalize(e.path().join("device")).unwrap_or_default();
        out.push(Nic { name, pci_path });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The canonical sysfs path of PCI function `bdf` (`0000:19:00.0`).
pub fn pci_path(sysfs: &Path, bdf: &str) -> Option<PathBuf> {
    std::fs::canonicalize(sysfs.join("bus/pci/devices").join(bdf)).ok()
}

/// Hops between two PCI functions through their nearest common bridge:
/// the path components after the common prefix, on both sides. Two
/// functions under one switch are 2 apart; across root complexes, more.
pub fn distance(a: &Path, b: &Path) -> usize {
    let (ca, cb): (Vec<_>, Vec<_>) = (a.components().collect(), b.components().collect());
    let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
    (ca.len() - common) + (cb.len() - common)
}

/// The NICs to use, best first.
///
/// * `wanted` (`FERRY_RDMA_DEV=name[,name]`): exactly those, in that
///   order; a name that does not exist is an error listing what does.
/// * else, with the GPU's bus id: the NICs nearest to it on the PCIe tree
///   (all at the minimum distance, by name).
/// * else: every NIC, by name.
pub fn choose(
    sysfs: &Path,
    gpu_bdf: Option<&str>,
    wanted: Option<&str>,
) -> Result<Vec<Nic>, crate::error::PathOff> {
    let listed =
        list(sysfs).map_err(|e| format!("reading {}/class/infiniband: {e}", sysfs.display()))?;
    if listed.is_empty() {
        return Err(PathOff::from(format!(
            "no RDMA device (nothing in {}/class/infiniband)",
            sysfs.display()
        )));
    }
    // A NIC whose port 1 sysfs says is not ACTIVE (down, initializing)
    // cannot carry a connection; one sysfs says nothing about is kept.
    let (all, down): (Vec<Nic>, Vec<Nic>) = listed
        .into_iter()
        .partition(|n| port_active(sysfs, &n.name, 1) != Some(false));
    if all.is_empty() {
        let names: Vec<&str> = down.iter().map(|n| n.name.as_str()).collect();
        return Err(PathOff::from(format!(
            "no RDMA device has an ACTIVE port 1 ({} are down)",
            names.join(", ")
        )));
    }
    if let Some(w) = wanted {
        let names: Vec<&str> = w
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if names.is_empty() {
            return Err("FERRY_RDMA_DEV is empty".into());
        }
        return names
            .iter()
            .map(|n| {
                all.iter().find(|d| d.name == *n).cloned().ok_or_else(|| {
                    let have: Vec<&str> = all.iter().map(|d| d.name.as_str()).collect();
                    PathOff::from(format!(
                        "FERRY_RDMA_DEV names {n:?}, which does not exist (devices: {})",
                        have.join(", ")
                    ))
                })
            })
            .collect();
    }
    // sysfs names PCI functions in lowercase; CUDA reports bus ids in
    // uppercase hex.
    let gpu = gpu_bdf
        .filter(|b| !b.is_empty())
        .and_then(|b| pci_path(sysfs, &b.to_ascii_lowercase()));
    let Some(gpu) = gpu else {
        return Ok(all);
    };
    let placed: Vec<(usize, &Nic)> = all
        .iter()
        .filter(|n| !n.pci_path.as_os_str().is_empty())
        .map(|n| (distance(&gpu, &n.pci_path), n))
        .collect();
    let Some(best) = placed.iter().map(|(d, _)| *d).min() else {
        return Ok(all);
    };
    Ok(placed
        .into_iter()
        .filter(|(d, _)| *d == best)
        .map(|(_, n)| n.clone())
        .collect())
}

/// Parses a sysfs GID (`fe80:0000:0000:0000:0202:c9ff:fe00:0001`).
fn parse_gid(s: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = s.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut g = [0u8; 16];
    for (k, h) in groups.iter().enumerate() {
        let v = u16::from_str_radix(h, 16).ok()?;
        g[2 * k..2 * k + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(g)
}

/// How good a GID is for a connection: RoCE v2 with an IPv4-mapped
/// address (routable, what RoCE fabrics mostly run) 3, another RoCE v2
/// non-link-local one 2, RoCE v2 link-local 1, RoCE v1 / InfiniBand 0.
/// `None`: an empty entry.
fn gid_score(gid: &[u8; 16], kind: &str) -> Option<u8> {
    if gid == &[0u8; 16] {
        return None;
    }
    if !kind.trim().eq_ignore_ascii_case("RoCE v2") {
        return Some(0);
    }
    let v4_mapped = gid[..10] == [0u8; 10] && gid[10..12] == [0xff, 0xff];
    let link_local = gid[0] == 0xfe && gid[1] & 0xc0 == 0x80;
    Some(if v4_mapped {
        3
    } else if !link_local {
        2
    } else {
        1
    })
}

/// A GID table entry as sysfs shows it, and how good it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidChoice {
    /// Its index in the port's GID table.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// `gid_attrs/types/<i>` ("RoCE v2", "IB/RoCE v1"; empty on IB ports
    /// of older kernels).
    pub kind: String,
    score: u8,
}

impl GidChoice {
    /// Why this GID (for `ferry info` and the log).
    pub fn reason(&self) -> &'static str {
        match self.score {
            3 => "RoCE v2, IPv4-mapped: routable",
            2 => "RoCE v2, global address",
            1 => "RoCE v2, link-local only: not routable",
            _ => "InfiniBand or RoCE v1 (the only kind on this port)",
        }
    }

    /// The GID as sysfs writes it.
    pub fn text(&self) -> String {
        self.gid
            .chunks(2)
            .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// The best GID index of `dev`'s `port` by its sysfs GID table (`gids/<i>`
/// and `gid_attrs/types/<i>`): the lowest index of the best score
/// (`gid_score`). `None` when the table cannot be read (the caller uses 0).
pub fn best_gid(sysfs: &Path, dev: &str, port: u8) -> Option<u32> {
    best_gid_choice(sysfs, dev, port).map(|c| c.index)
}

/// `best_gid` with the entry it picked.
pub fn best_gid_choice(sysfs: &Path, dev: &str, port: u8) -> Option<GidChoice> {
    let base = sysfs.join(format!("class/infiniband/{dev}/ports/{port}"));
    let mut best: Option<GidChoice> = None;
    for e in std::fs::read_dir(base.join("gids")).ok()?.flatten() {
        let Ok(idx) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Some(gid) = std::fs::read_to_string(e.path())
            .ok()
            .and_then(|t| parse_gid(&t))
        else {
            continue;
        };
        // No type file (InfiniBand ports on older kernels): type IB.
        let kind = std::fs::read_to_string(base.join(format!("gid_attrs/types/{idx}")))
            .unwrap_or_default();
        if let Some(score) = gid_score(&gid, &kind) {
            let better = match &best {
                None => true,
                Some(b) => score > b.score || (score == b.score && idx < b.index),
            };
            if better {
                best = Some(GidChoice {
                    index: idx,
                    gid,
                    kind: kind.trim().to_owned(),
                    score,
                });
            }
        }
    }
    best
}

/// A port's sysfs facts for `ferry info`: (state, link layer), each as
/// sysfs words it ("4: ACTIVE", "Ethernet"), `None` where unreadable.
pub fn port_facts(sysfs: &Path, dev: &str, port: u8) -> (Option<String>, Option<String>) {
    let base = sysfs.join(format!("class/infiniband/{dev}/ports/{port}"));
    let read = |f: &str| {
        std::fs::read_to_string(base.join(f))
            .ok()
            .map(|s| s.trim().to_owned())
    };
    (read("state"), read("link_layer"))
}

/// Whether `dev`'s `port` is ACTIVE by sysfs (`ports/<p>/state`, e.g.
/// "4: ACTIVE"); `None` when the file cannot be read.
pub fn port_active(sysfs: &Path, dev: &str, port: u8) -> Option<bool> {
    let p = sysfs.join(format!("class/infiniband/{dev}/ports/{port}/state"));
    let s = std::fs::read_to_string(p).ok()?;
    Some(s.to_ascii_uppercase().contains("ACTIVE") && !s.to_ascii_uppercase().contains("INIT"))
}

#[cfg(test)]
mod tests {

    fn port(root: &Path, dev: &str, state: &str, gids: &[(u32, &str, &str)]) {
        let p = root.join(format!("class/infiniband/{dev}/ports/1"));
        std::fs::create_dir_all(p.join("gids")).unwrap();
        std::fs::create_dir_all(p.join("gid_attrs/types")).unwrap();
        std::fs::write(p.join("state"), state).unwrap();
        for (i, gid, kind) in gids {
            std::fs::write(p.join(format!("gids/{i}")), format!("{gid}\n")).unwrap();
            std::fs::write(p.join(format!("gid_attrs/types/{i}")), format!("{kind}\n")).unwrap();
        }
    }

    const ZERO: &str = "0000:0000:0000:0000:0000:0000:0000:0000";
    const LL: &str = "fe80:0000:0000:0000:0202:c9ff:fe00:0001";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:0a00:0001";

    #[test]
    fn roce_v2_ipv4_mapped_gids_are_preferred() {
        let s = fake();
        // A ConnectX RoCE port: v1 and v2 link-local at 0/1, v1 and v2
        // IPv4-mapped at 2/3, an empty entry.
        port(
            &s,
            "mlx5_0",
            "4: ACTIVE",
            &[
                (0, LL, "IB/RoCE v1"),
                (1, LL, "RoCE v2"),
                (2, V4, "IB/RoCE v1"),
                (3, V4, "RoCE v2"),
                (4, ZERO, "RoCE v2"),
            ],
        );
        assert_eq!(best_gid(&s, "mlx5_0", 1), Some(3));
        // Only link-local: RoCE v2 over v1.
        port(
            &s,
            "mlx5_1",
            "4: ACTIVE",
            &[(0, LL, "IB/RoCE v1"), (1, LL, "RoCE v2")],
        );
        assert_eq!(best_gid(&s, "mlx5_1", 1), Some(1));
        // An InfiniBand port: its GIDs are all "IB"; the first one.
        port(
            &s,
            "mlx5_2",
            "4: ACTIVE",
            &[(0, LL, "IB/RoCE v1"), (1, LL, "IB/RoCE v1")],
        );
        assert_eq!(best_gid(&s, "mlx5_2", 1), Some(0));
        assert_eq!(best_gid(&s, "mlx5_9", 1), None);
        assert_eq!(parse_gid("fe80::1"), None);
        std::fs::remove_dir_all(&s).unwrap();
    }

    #[test]
    fn inactive_ports_are_skipped_and_bus_ids_are_matched_in_lowercase() {
        let s = fake();
        // The GPU's own NIC is down: the next nearest active ones win.
        port(&s, "mlx5_0", "1: DOWN", &[]);
        port(&s, "mlx5_1", "4: ACTIVE", &[]);
        port(&s, "mlx5_2", "4: ACTIVE", &[]);
        assert_eq!(
            names(&choose(&s, Some("0000:19:00.0"), None).unwrap()),
            ["mlx5_2"]
        );
        port(&s, "mlx5_0", "4: ACTIVE", &[]);
        // CUDA's uppercase form of a bus id finds the same function.
        std::fs::create_dir_all(s.join("bus/pci/devices")).unwrap();
        let gpu = pci_path(&s, "0000:19:00.0").unwrap();
        std::os::unix::fs::symlink(&gpu, s.join("bus/pci/devices/0000:1b:00.0")).unwrap();
        assert_eq!(
            names(&choose(&s, Some("0000:1B:00.0"), None).unwrap()),
            ["mlx5_0"]
        );
        for n in ["mlx5_0", "mlx5_1", "mlx5_2"] {
            port(&s, n, "1: DOWN", &[]);
        }
        let e = choose(&s, None, None).unwrap_err();
        assert!(e.why.contains("ACTIVE") && e.why.contains("mlx5_1"), "{e}");
        std::fs::remove_dir_all(&s).unwrap();
    }

    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake sysfs: two root complexes; GPU 0000:19:00.0 and mlx5_0 under
    /// one switch, mlx5_1 under the other root, mlx5_2 on the first root
    /// but another switch.
    fn fake() -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "ferry-sysfs-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let dev = |p: &str| {
            let d = root.join("devices").join(p);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let gpu = dev("pci0000:00/0000:00:01.0/0000:10:00.0/0000:19:00.0");
        let n0 = dev("pci0000:00/0000:00:01.0/0000:10:00.0/0000:1a:00.0");
        let n1 = dev("pci0000:80/0000:80:01.0/0000:90:00.0/0000:9a:00.0");
        let n2 = dev("pci0000:00/0000:00:02.0/0000:20:00.0/0000:2a:00.0");
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        symlink(&gpu, root.join("bus/pci/devices/0000:19:00.0")).unwrap();
        for (name, d) in [("mlx5_0", &n0), ("mlx5_1", &n1), ("mlx5_2", &n2)] {
            let c = root.join("class/infiniband").join(name);
            std::fs::create_dir_all(&c).unwrap();
            symlink(d, c.join("device")).unwrap();
        }
        root
    }

    fn names(v: &[Nic]) -> Vec<&str> {
        v.iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn nearest_nic_to_the_gpu_wins() {
        let s = fake();
        assert_eq!(
            names(&choose(&s, Some("0000:19:00.0"), None).unwrap()),
            ["mlx5_0"]
        );
        // Without a GPU: all, by name.
        assert_eq!(
            names(&choose(&s, None, None).unwrap()),
            ["mlx5_0", "mlx5_1", "mlx5_2"]
        );
        // A GPU sysfs does not know: all, by name.
        assert_eq!(
            names(&choose(&s, Some("0000:77:00.0"), None).unwrap()).len(),
            3
        );
        std::fs::remove_dir_all(&s).unwrap();
    }

    #[test]
    fn every_nic_at_the_gpus_distance_is_chosen_in_name_order() {
        // A second NIC under the GPU's own switch (as on an 8-GPU HGX
        // board with two NICs per switch): both, by name; the others not.
        let s = fake();
        let n3 = s.join("devices/pci0000:00/0000:00:01.0/0000:10:00.0/0000:1b:00.0");
        std::fs::create_dir_all(&n3).unwrap();
        let c = s.join("class/infiniband/mlx5_3");
        std::fs::create_dir_all(&c).unwrap();
        symlink(&n3, c.join("device")).unwrap();
        assert_eq!(
            names(&choose(&s, Some("0000:19:00.0"), None).unwrap()),
            ["mlx5_0", "mlx5_3"]
        );
        std::fs::remove_dir_all(&s).unwrap();
    }

    #[test]
    fn distances_follow_the_tree() {
        let s = fake();
        let gpu = pci_path(&s, "0000:19:00.0").unwrap();
        let nics = list(&s).unwrap();
        let d: Vec<usize> = nics.iter().map(|n| distance(&gpu, &n.pci_path)).collect();
        // Same switch: 2; same root, other switch: 6; other root: 8.
        assert_eq!(d, [2, 8, 6]);
        std::fs::remove_dir_all(&s).unwrap();
    }

    #[test]
    fn override_names_devices_and_rejects_unknown_ones() {
        let s = fake();
        let got = choose(&s, Some("0000:19:00.0"), Some("mlx5_2, mlx5_1")).unwrap();
        assert_eq!(names(&got), ["mlx5_2", "mlx5_1"]);
        let e = choose(&s, None, Some("mlx5_9")).unwrap_err();
        assert!(
            e.why.contains("mlx5_9") && e.why.contains("mlx5_0, mlx5_1, mlx5_2"),
            "{e}"
        );
        assert!(choose(&s, None, Some(" , ")).is_err());
        std::fs::remove_dir_all(&s).unwrap();
    }

    #[test]
    fn no_devices_is_a_reason_not_a_panic() {
        let empty = std::env::temp_dir().join(format!("ferry-sysfs-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let e = choose(&empty, None, None).unwrap_err();
        assert!(e.why.contains("no RDMA device"), "{e}");
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
