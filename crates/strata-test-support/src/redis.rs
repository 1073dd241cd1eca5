//! redis-server processes for the tests (Debian package redis-server; scripts/test.sh installs
//! it and redis-cli): one instance, or a Redis Cluster of masters and replicas.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

fn spawn_redis(port: u16, extra: &[String]) -> Child {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server is missing: install the Debian package redis-server (scripts/test.sh does)");
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "redis-server did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// `redis-cli -p PORT ARGS...`: its output, trimmed (panics if it cannot run or fails).
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect(
            "redis-cli is missing: install the Debian package redis-tools (scripts/test.sh does)",
        );
    assert!(
        out.status.success(),
        "redis-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A redis-server on a loopback port, killed when dropped.
pub struct Redis {
    pub port: u16,
    child: Child,
}

impl Redis {
    /// Starts one on `port` and waits until it accepts connections.
    pub fn start_on(port: u16) -> Redis {
        Redis {
            port,
            child: spawn_redis(port, &[]),
        }
    }
    /// Starts one on a free port.
    pub fn start() -> Redis {
        Redis::start_on(free_port())
    }
    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
    /// Kills it (a test of Redis going away).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One node of a [`RedisCluster`].
pub struct ClusterNode {
    pub port: u16,
    bus: u16,
    child: Option<Child>,
}

/// A Redis Cluster on loopback ports: node timeout 1 s (failover within a few seconds), full
/// coverage not required, no persistence; each node's cluster state in a temporary directory of its own, so a killed
/// node restarts as the same node. Every node is killed when dropped.
pub struct RedisCluster {
    pub nodes: Vec<ClusterNode>,
    dir: tempfile::TempDir,
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each, created by `redis-cli --cluster create`,
    /// and waited for until every node reports `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let mut c = RedisCluster {
            nodes: Vec::new(),
            dir: tempfile::tempdir().unwrap(),
        };
        for _ in 0..masters * (1 + replicas) {
            c.spawn_node();
        }
        let addrs: Vec<String> = c
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli is missing: install the Debian package redis-tools (scripts/test.sh does)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        c.wait_ok();
        c
    }

    fn spawn_node(&mut self) -> usize {
        let (port, bus) = (free_port(), free_port());
        let node = ClusterNode {
            port,
            bus,
            child: None,
        };
        self.nodes.push(node);
        let i = self.nodes.len() - 1;
        self.restart(i);
        i
    }

    fn node_args(&self, i: usize) -> Vec<String> {
        let n = &self.nodes[i];
        // A directory per node: a replica writes the snapshot it syncs from its master to
        // `dump.rdb` there, and a node started on another node's snapshot would claim its
        // slots.
        let dir: PathBuf = self.dir.path().join(n.port.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        [
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            &n.bus.to_string(),
            "--cluster-config-file",
            &format!("nodes-{}.conf", n.port),
            "--cluster-node-timeout",
            "1000",
            // As a cache wants it: the other masters keep serving while one range is down.
            "--cluster-require-full-coverage",
            "no",
            "--dir",
            dir.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// `redis://` URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("redis://127.0.0.1:{}", self.nodes[i].port)
    }

    /// `redis-cli` against node `i`.
    pub fn cli(&self, i: usize, args: &[&str]) -> String {
        redis_cli(self.nodes[i].port, args)
    }

    /// Kills node `i` (its cluster state stays on disk).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut ch) = self.nodes[i].child.take() {
            let _ = ch.kill();
            let _ = ch.wait();
        }
    }

    /// (Re)starts node `i` with its cluster state: a former master rejoins as a replica of
    /// the one promoted in its place.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        let args = self.node_args(i);
        self.nodes[i].child = Some(spawn_redis(self.nodes[i].port, &args));
    }

    /// Whether node `i` runs.
    pub fn running(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    /// Running nodes that are masters now (by `ROLE`).
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.running(i) && self.cli(i, &["ROLE"]).starts_with("master"))
            .collect()
    }

    /// Waits (up to 60 s) until every running node reports `cluster_state:ok`.
    pub fn wait_ok(&self) {
        let t = Instant::now();
        loop {
            let ok = (0..self.nodes.len()).filter(|&i| self.running(i)).all(|i| {
                self.cli(i, &["CLUSTER", "INFO"])
                    .contains("cluster_state:ok")
            });
            if ok {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the Redis Cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a new node, adds it as an empty master and moves slots (with their keys) onto it
    /// (`redis-cli --cluster add-node`, then `rebalance --cluster-use-empty-masters`). Returns
    /// its index.
    pub fn add_master(&mut self) -> usize {
        let i = self.spawn_node();
        let new = format!("127.0.0.1:{}", self.nodes[i].port);
        let any = self.masters()[0];
        let old = format!("127.0.0.1:{}", self.nodes[any].port);
        let run = |args: &[&str]| {
            let out = Command::new("redis-cli").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "redis-cli {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["--cluster", "add-node", &new, &old]);
        // The new node must know the cluster, and be known to every node, before slots move.
        let t = Instant::now();
        while !(0..self.nodes.len()).filter(|&j| self.running(j)).all(|j| {
            self.cli(j, &["CLUSTER", "NODES"])
                .lines()
                .filter(|l| !l.contains("fail"))
                .count()
                >= self.nodes.iter().filter(|n| n.child.is_some()).count()
        }) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the new node did not join"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_ok();
        run(&[
            "--cluster",
            "rebalance",
            &old,
            "--cluster-use-empty-masters",
            "--cluster-yes",
        ]);
        self.wait_ok();
        i
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
