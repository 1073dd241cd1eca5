//! A test bed of several hosts made of Linux network namespaces (root only): each host a
//! namespace with one interface (`eth0`, an address of the private test subnet 10.77.0.0/24)
//! on a bridge that lives in a namespace of its own, so nothing of it is visible outside.
//! Links are shaped on every host's `eth0`: `tc netem` delay and rate where the kernel has
//! netem, otherwise a `tc tbf` rate and the delay added by [`Relay`]s (a userspace hop that
//! holds every chunk the delay in each direction). `ip` and `tc` come from Debian's iproute2.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One host of the bed.
pub struct Host {
    pub name: String,
    /// Its namespace (`ip netns` name).
    pub ns: String,
    pub ip: Ipv4Addr,
}

/// The bed; its namespaces are deleted when dropped (stop the processes in them first).
pub struct NetBed {
    switch: String,
    pub hosts: Vec<Host>,
    netem: bool,
}

/// Runs an iproute2 program; its error output is the error.
fn iproute2(mut c: Command, what: &str, args: &[&str]) -> Result<(), String> {
    let out = c
        .args(args)
        .output()
        .map_err(|e| format!("{what}: {e} (install iproute2)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    iproute2(Command::new("ip"), "ip", args)
}

fn tc(ns: &str, args: &[&str]) -> Result<(), String> {
    let mut c = Command::new("tc");
    c.args(["-n", ns]);
    iproute2(c, "tc", args)
}

/// One link setting: one-way delay and rate of every host's interface.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    pub delay: Duration,
    /// Bits per second (0: unlimited).
    pub rate_bit: u64,
}

impl NetBed {
    /// Makes a host per name (addresses 10.77.0.1, .2, ... in order), or says why it cannot
    /// (not root, no `ip`, namespaces refused).
    pub fn create(names: &[&str]) -> Result<NetBed, String> {
        let tag = format!("st{}", std::process::id());
        let switch = format!("{tag}-sw");
        ip(&["netns", "add", &switch])?;
        let mut bed = NetBed {
            switch: switch.clone(),
            hosts: Vec::new(),
            netem: false,
        };
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for (i, name) in names.iter().enumerate() {
            let ns = format!("{tag}-{name}");
            ip(&["netns", "add", &ns])?;
            let addr = Ipv4Addr::new(10, 77, 0, i as u8 + 1);
            bed.hosts.push(Host {
                name: name.to_string(),
                ns: ns.clone(),
                ip: addr,
            });
            let (h, b) = (format!("{tag}h{i}"), format!("{tag}b{i}"));
            ip(&["link", "add", &h, "type", "veth", "peer", "name", &b])?;
            ip(&["link", "set", &h, "netns", &ns])?;
            ip(&["link", "set", &b, "netns", &switch])?;
            ip(&["-n", &ns, "link", "set", &h, "name", "eth0"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &switch, "link", "set", &b, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &b, "up"])?;
        }
        let first = &bed.hosts[0].ns;
        let probe = |args: &[&str]| -> bool {
            let ok = tc(first, args).is_ok();
            let _ = tc(first, &["qdisc", "del", "dev", "eth0", "root"]);
            ok
        };
        bed.netem = probe(&[
            "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms",
        ]);
        let tbf = probe(&[
            "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1gbit", "burst", "65536",
            "latency", "20ms",
        ]);
        if !bed.netem && !tbf {
            return Err("the kernel has neither the netem nor the tbf qdisc to shape links".into());
        }
        Ok(bed)
    }

    /// Whether the kernel has netem (else delays must come from [`Relay`]s).
    pub fn netem(&self) -> bool {
        self.netem
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name}"))
    }

    /// Shapes every host's interface: netem delay and rate, or (without netem) a tbf rate
    /// only. A rate of 0 and no delay removes the shaping.
    pub fn shape(&self, link: Link) -> Result<(), String> {
        for h in &self.hosts {
            let _ = tc(&h.ns, &["qdisc", "del", "dev", "eth0", "root"]);
            let rate = format!("{}bit", link.rate_bit);
            let delay = format!("{}us", link.delay.as_micros());
            if self.netem && (link.rate_bit > 0 || !link.delay.is_zero()) {
                let mut args = vec![
                    "qdisc", "add", "dev", "eth0", "root", "netem", "delay", &delay, "limit",
                    "100000",
                ];
                if link.rate_bit > 0 {
                    args.extend(["rate", &rate]);
                }
                tc(&h.ns, &args)?;
            } else if link.rate_bit > 0 {
                // A bucket of 4 ms of the rate (at least 64 KiB, a GSO packet), 20 ms of queue.
                let burst = format!("{}", (link.rate_bit / 8 / 250).max(65_536));
                tc(
                    &h.ns,
                    &[
                        "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &rate, "burst",
                        &burst, "latency", "20ms",
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// Takes a host's link down (cut off from every other host) or back up.
    pub fn set_link(&self, name: &str, up: bool) -> Result<(), String> {
        let h = self.host(name);
        ip(&[
            "-n",
            &h.ns,
            "link",
            "set",
            "eth0",
            if up { "up" } else { "down" },
        ])
    }

    /// `program` to run on a host (`ip netns exec NS program`).
    pub fn command(&self, name: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.host(name).ns, program]);
        c
    }
}

impl Drop for NetBed {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.ns]);
        }
        let _ = ip(&["netns", "del", &self.switch]);
    }
}

/// Moves this thread into a network namespace (`None`: the one `orig` is, the process's own).
fn enter(ns: Option<&str>, orig: &File) -> io::Result<()> {
    let f;
    let fd = match ns {
        Some(ns) => {
            f = File::open(format!("/run/netns/{ns}"))?;
            f.as_fd()
        }
        None => orig.as_fd(),
    };
    rustix::thread::move_into_link_name_space(fd, Some(rustix::thread::LinkNameSpaceType::Network))
        .map_err(io::Error::from)
}

/// A TCP relay: listens in one namespace and connects in another (sockets belong to the
/// namespace of the thread that makes them: the relay's thread makes its listener there, then
/// moves), holding every chunk [`Relay::set_delay`] in each direction. Stopped when dropped.
pub struct Relay {
    /// Where it listens.
    pub addr: SocketAddr,
    delay_us: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    /// Listens on `listen` (port 0: any) in `listen_ns` and forwards each connection to `to`
    /// from `connect_ns` (`None`: this process's namespace).
    pub fn start(
        listen_ns: Option<&str>,
        listen: SocketAddr,
        connect_ns: Option<&str>,
        to: SocketAddr,
    ) -> io::Result<Relay> {
        let delay_us = Arc::new(AtomicU64::new(0));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<SocketAddr>>();
        let (lns, cns) = (
            listen_ns.map(str::to_string),
            connect_ns.map(str::to_string),
        );
        let d = delay_us.clone();
        let thread = std::thread::spawn(move || {
            let setup = || -> io::Result<(std::net::TcpListener, tokio::runtime::Runtime)> {
                let orig = File::open("/proc/thread-self/ns/net")?;
                enter(lns.as_deref(), &orig)?;
                let l = std::net::TcpListener::bind(listen)?;
                l.set_nonblocking(true)?;
                enter(cns.as_deref(), &orig)?;
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                Ok((l, rt))
            };
            let (l, rt) = match setup() {
                Ok(x) => x,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(l.local_addr());
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(l).expect("a tokio listener");
                let accept = async {
                    while let Ok((c, _)) = l.accept().await {
                        tokio::spawn(relay_one(c, to, d.clone()));
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stop_rx => {}
                }
            });
        });
        let addr = ready_rx
            .recv()
            .map_err(|_| io::Error::other("the relay thread died"))??;
        Ok(Relay {
            addr,
            delay_us,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The delay every chunk is held, each way.
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn relay_one(c: tokio::net::TcpStream, to: SocketAddr, delay_us: Arc<AtomicU64>) {
    let Ok(up) = tokio::net::TcpStream::connect(to).await else {
        return;
    };
    let _ = (c.set_nodelay(true), up.set_nodelay(true));
    let (cr, cw) = c.into_split();
    let (ur, uw) = up.into_split();
    tokio::join!(pump(cr, uw, delay_us.clone()), pump(ur, cw, delay_us));
}

/// Copies one direction, each chunk sent `delay` after it arrived (chunks keep flowing
/// meanwhile: the delay adds latency, not a limit on throughput).
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay_us: Arc<AtomicU64>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(256);
    let read = async move {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let due = tokio::time::Instant::now()
                + Duration::from_micros(delay_us.load(Ordering::Relaxed));
            if tx.send((due, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, b)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if w.write_all(&b).await.is_err() {
                return;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(read, write);
}
