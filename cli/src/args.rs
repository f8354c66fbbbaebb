//! A small flag parser: `--name value`, `--name=value` and bare `--switch`.

use anyhow::{anyhow, bail, Context, Result};

pub struct Args {
    items: Vec<(String, Option<String>)>,
    used: Vec<bool>,
}

impl Args {
    /// `switches` are the flags that take no value.
    pub fn parse(raw: &[String], switches: &[&str]) -> Result<Args> {
        let mut items = Vec::new();
        let mut i = 0;
        while i < raw.len() {
            let a = &raw[i];
            let Some(name) = a.strip_prefix("--") else {
                bail!("unexpected argument {a:?} (flags start with --)")
            };
            if let Some((n, v)) = name.split_once('=') {
                items.push((n.to_owned(), Some(v.to_owned())));
            } else if switches.contains(&name) {
                items.push((name.to_owned(), None));
            } else {
                let v = raw
                    .get(i + 1)
                    .ok_or_else(|| anyhow!("--{name} needs a value"))?;
                items.push((name.to_owned(), Some(v.clone())));
                i += 1;
            }
            i += 1;
        }
        let used = vec![false; items.len()];
        Ok(Args { items, used })
    }

    pub fn switch(&mut self, name: &str) -> bool {
        let mut hit = false;
        for (i, (n, _)) in self.items.iter().enumerate() {
            if n == name {
                self.used[i] = true;
                hit = true;
            }
        }
        hit
    }

    pub fn value(&mut self, name: &str) -> Option<String> {
        let mut out = None;
        for (i, (n, v)) in self.items.iter().enumerate() {
            if n == name {
                self.used[i] = true;
                out = v.clone();
            }
        }
        out
    }

    pub fn parsed<T: std::str::FromStr>(&mut self, name: &str, default: T) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        match self.value(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|e| anyhow!("--{name} {v:?}: {e}")),
        }
    }

    /// Fails on any flag nobody asked for.
    pub fn finish(self) -> Result<()> {
        for (i, (n, _)) in self.items.iter().enumerate() {
            if !self.used[i] {
                bail!("unknown flag --{n} (see --help)");
            }
        }
        Ok(())
    }
}

/// Parses "4K", "64KiB", "1M", "16MB", "1G" or a plain byte count (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().with_context(|| format!("size {s:?}"))?;
    let mult = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        u => bail!("size {s:?}: unknown unit {u:?}"),
    };
    n.checked_mul(mult)
        .ok_or_else(|| anyhow!("size {s:?} overflows"))
}

pub fn fmt_size(n: usize) -> String {
    if n >= 1 << 30 && n % (1 << 30) == 0 {
        format!("{} GiB", n >> 30)
    } else if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("8").unwrap(), 8);
        assert!(parse_size("4Q").is_err());
        assert_eq!(fmt_size(64 << 20), "64 MiB");
    }
}
