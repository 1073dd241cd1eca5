//! NUMA topology from sysfs: nodes, their CPUs and memory.
//!
//! Read from `<root>/devices/system/node/node*/{meminfo,cpulist}` (root `/sys` normally; tests
//! pass a fake tree). A node's available memory is `MemFree + Inactive(file)` (free plus page
//! cache the kernel can drop at once). Some VMs under-report node meminfo (this project's machines
//! show ~7 GiB on node0 of 24 GiB); on a single-node system the larger of node meminfo and
//! `<root>/../proc/meminfo` (`MemAvailable`) is used, and the source is always recorded.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TopologyError {
    #[error("cannot read NUMA topology at {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("no NUMA node found under {0}")]
    NoNodes(String),
    #[error("{path}: cannot parse `{text}` as a CPU list")]
    CpuList { path: String, text: String },
}

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Node {
    pub id: u32,
    pub cpus: Vec<u32>,
    pub total_bytes: u64,
    pub available_bytes: u64,
    /// Where the figures came from.
    pub source: String,
}

/// All nodes of the machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub nodes: Vec<Node>,
}

fn read(p: &Path) -> Result<String, TopologyError> {
    fs::read_to_string(p).map_err(|e| TopologyError::Read {
        path: p.display().to_string(),
        reason: e.to_string(),
    })
}

/// Parses `0-3,8,10-11`.
pub fn parse_cpulist(text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.trim().parse().ok()?),
        }
    }
    Some(out)
}

/// `Key: value kB` lines (node meminfo prefixes them with `Node N `).
fn meminfo_kb(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let l = l.trim_start();
        let l = match l.strip_prefix("Node ") {
            Some(rest) => rest.split_once(' ')?.1.trim_start(),
            None => l,
        };
        let v = l.strip_prefix(key)?.strip_prefix(':')?;
        v.split_whitespace().next()?.parse().ok()
    })
}

impl Topology {
    /// Reads the machine's topology (`/sys`, `/proc`).
    pub fn detect() -> Result<Topology, TopologyError> {
        Topology::from_root(Path::new("/sys"), Path::new("/proc/meminfo"))
    }

    /// Reads `<sys>/devices/system/node`; `proc_meminfo` is the system-wide meminfo.
    pub fn from_root(sys: &Path, proc_meminfo: &Path) -> Result<Topology, TopologyError> {
        let dir: PathBuf = sys.join("devices/system/node");
        let entries = fs::read_dir(&dir).map_err(|e| TopologyError::Read {
            path: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut nodes = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let mi_path = e.path().join("meminfo");
            let mi = read(&mi_path)?;
            let total = meminfo_kb(&mi, "MemTotal").ok_or_else(|| TopologyError::Read {
                path: mi_path.display().to_string(),
                reason: "no MemTotal line".into(),
            })? * 1024;
            let free = meminfo_kb(&mi, "MemFree").unwrap_or(0) * 1024;
            let cache = meminfo_kb(&mi, "Inactive(file)").unwrap_or(0) * 1024;
            let cl_path = e.path().join("cpulist");
            let cl = read(&cl_path)?;
            let cpus = parse_cpulist(&cl).ok_or_else(|| TopologyError::CpuList {
                path: cl_path.display().to_string(),
                text: cl.trim().to_string(),
            })?;
            nodes.push(Node {
                id,
                cpus,
                total_bytes: total,
                available_bytes: (free + cache).min(total),
                source: format!("{} (MemFree + Inactive(file))", mi_path.display()),
            });
        }
        if nodes.is_empty() {
            return Err(TopologyError::NoNodes(dir.display().to_string()));
        }
        nodes.sort_by_key(|n| n.id);
        if nodes.len() == 1 {
            if let Ok(text) = fs::read_to_string(proc_meminfo) {
                let total = meminfo_kb(&text, "MemTotal").unwrap_or(0) * 1024;
                let avail = meminfo_kb(&text, "MemAvailable").unwrap_or(0) * 1024;
                let n = &mut nodes[0];
                if total > n.total_bytes {
                    n.source = format!(
                        "{} MemAvailable: the only node's sysfs meminfo reports {} of {} total, under-reported",
                        proc_meminfo.display(),
                        strata_kv::units::format_bytes(n.total_bytes),
                        strata_kv::units::format_bytes(total)
                    );
                    n.total_bytes = total;
                    n.available_bytes = avail.min(total);
                }
            }
        }
        Ok(Topology { nodes })
    }

    pub fn node(&self, id: u32) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }

    pub fn ids(&self) -> Vec<u32> {
        self.nodes.iter().map(|n| n.id).collect()
    }
}

/// Writes a fake sysfs tree for tests and examples: `(id, cpulist, total_kb, free_kb)`.
pub fn write_fake_sysfs(root: &Path, nodes: &[(u32, &str, u64, u64)]) -> std::io::Result<()> {
    for &(id, cpus, total, free) in nodes {
        let d = root.join(format!("devices/system/node/node{id}"));
        fs::create_dir_all(&d)?;
        fs::write(d.join("cpulist"), format!("{cpus}\n"))?;
        fs::write(
            d.join("meminfo"),
            format!(
                "Node {id} MemTotal:       {total} kB\nNode {id} MemFree:        {free} kB\nNode {id} MemUsed:        {} kB\nNode {id} Inactive(file):  0 kB\n",
                total - free
            ),
        )?;
    }
    fs::create_dir_all(root.join("devices/system/node"))?;
    fs::write(root.join("devices/system/node/online"), "0\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn two_node_fake_tree() {
        let d = tempfile::tempdir().unwrap();
        let gb = 1_000_000_000 / 1024;
        write_fake_sysfs(
            d.path(),
            &[
                (0, "0-47", 240 * gb, 230 * gb),
                (1, "48-95", 240 * gb, 228 * gb),
            ],
        )
        .unwrap();
        let t = Topology::from_root(d.path(), &d.path().join("none")).unwrap();
        assert_eq!(t.ids(), vec![0, 1]);
        assert_eq!(t.node(1).unwrap().cpus.len(), 48);
        assert_eq!(t.node(0).unwrap().available_bytes, 230 * gb * 1024);
        assert!(t.node(0).unwrap().source.contains("node0/meminfo"));
    }

    #[test]
    fn single_node_under_reporting_uses_proc_meminfo_and_says_so() {
        let d = tempfile::tempdir().unwrap();
        write_fake_sysfs(d.path(), &[(0, "0-1", 7_000_000, 4_000_000)]).unwrap();
        let proc = d.path().join("meminfo");
        fs::write(&proc, "MemTotal:       24000000 kB\nMemFree:        20000000 kB\nMemAvailable:   23000000 kB\n").unwrap();
        let t = Topology::from_root(d.path(), &proc).unwrap();
        let n = &t.nodes[0];
        assert_eq!(n.total_bytes, 24_000_000 * 1024);
        assert_eq!(n.available_bytes, 23_000_000 * 1024);
        assert!(n.source.contains("under-reported"), "{}", n.source);
    }

    #[test]
    fn missing_tree_is_a_clear_error() {
        let d = tempfile::tempdir().unwrap();
        let e = Topology::from_root(&d.path().join("nope"), Path::new("/x"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("cannot read NUMA topology at "), "{e}");
    }

    #[test]
    fn this_machine() {
        let t = Topology::detect().unwrap();
        assert!(!t.nodes.is_empty());
        assert!(t
            .nodes
            .iter()
            .all(|n| n.available_bytes <= n.total_bytes && n.total_bytes > 0));
    }
}
