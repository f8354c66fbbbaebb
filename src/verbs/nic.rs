//! Which RDMA NIC an endpoint uses: the one(s) nearest its GPU on the PCIe
//! tree, read from sysfs (the seed picks NICs by PCIe distance too), or the
//! ones `FERRY_RDMA_DEV` names. Pure file-system logic: tests run it on a
//! fake sysfs tree.

use std::path::{Path, PathBuf};

/// An RDMA device and where it sits on the PCIe tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
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
) -> Result<Vec<Nic>, String> {
    let all =
        list(sysfs).map_err(|e| format!("reading {}/class/infiniband: {e}", sysfs.display()))?;
    if all.is_empty() {
        return Err("no RDMA device (nothing in /sys/class/infiniband)".into());
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
                    format!(
                        "FERRY_RDMA_DEV names {n:?}, which does not exist (devices: {})",
                        have.join(", ")
                    )
                })
            })
            .collect();
    }
    let gpu = gpu_bdf
        .filter(|b| !b.is_empty())
        .and_then(|b| pci_path(sysfs, b));
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

#[cfg(test)]
mod tests {
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
            e.contains("mlx5_9") && e.contains("mlx5_0, mlx5_1, mlx5_2"),
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
        assert!(e.contains("no RDMA device"), "{e}");
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
