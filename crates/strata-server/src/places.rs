//! Places for connections that have not earned their keep yet, shared by the HTTP listeners
//! (router and workers) and the KV listener: a bounded number in all and per address, where a
//! newcomer is not refused because idle strangers hold the places.
//!
//! An entry is *idle* while it does no work for anybody: an HTTP connection waiting for a
//! request's headers (fresh, or between keep-alive requests), a KV connection before its
//! handshake. When admitting a newcomer would break a bound, one idle entry yields (its
//! handle is returned to the caller, who closes it):
//!
//! 1. The newcomer's address is at its cap: that address's longest-idle entry yields, if it
//!    has been idle at least `protect` (a flood from one address cannot push out its own
//!    connections that are still completing their first exchange); otherwise the newcomer
//!    is refused.
//! 2. The total is at its cap: if some address holds at least two places more than the
//!    newcomer's, the longest-idle entry among the addresses holding the most (with an idle
//!    entry) yields, whatever its age: an address well below another's share always gets in
//!    (and the two cannot trade one place back and forth). Otherwise the longest-idle entry
//!    anywhere yields if idle at least `protect`, else the newcomer is refused.
//!
//! Addresses are counted as IPv4 addresses and IPv6 /64 prefixes (one host's usual share).

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The bounds of one set of places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaceLimits {
    /// Places in all.
    pub total: usize,
    /// Places held by one address.
    pub per_addr: usize,
    /// An entry idle for less than this yields only to an address below its share.
    pub protect: Duration,
}

/// The key an address is counted under: IPv4 as it is (also when mapped into IPv6), IPv6
/// by its /64.
pub fn addr_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = a.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

struct Entry<H> {
    addr: IpAddr,
    /// Requests in progress (an HTTP connection's; a KV connection never has any).
    busy: u32,
    /// Idle since (meaningful while `busy == 0`).
    since: Instant,
    handle: H,
}

#[derive(Default)]
struct Addr {
    held: usize,
    idle: BTreeSet<(Instant, u64)>,
}

struct Inner<H> {
    next: u64,
    entries: HashMap<u64, Entry<H>>,
    idle: BTreeSet<(Instant, u64)>,
    by_addr: HashMap<IpAddr, Addr>,
    /// (places held, address), to find the heaviest addresses.
    heavy: BTreeSet<(usize, IpAddr)>,
}

/// A set of places; `H` is what the caller needs to close an entry that yields.
pub struct Places<H> {
    limits: PlaceLimits,
    inner: Mutex<Inner<H>>,
}

/// The verdict on a newcomer.
pub enum Admit<H> {
    /// Admitted with this place; `yielded`, if any, lost its place to it and must be closed.
    Yes { place: Place<H>, yielded: Option<H> },
    /// Every place is taken by entries that may not yield.
    No,
}

impl<H> Places<H> {
    pub fn new(limits: PlaceLimits) -> Arc<Places<H>> {
        Arc::new(Places {
            limits,
            inner: Mutex::new(Inner {
                next: 0,
                entries: HashMap::new(),
                idle: BTreeSet::new(),
                by_addr: HashMap::new(),
                heavy: BTreeSet::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<H>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Places held now.
    pub fn held(&self) -> usize {
        self.lock().entries.len()
    }

    /// Admits a newcomer from `ip` (idle from now), or says no. `outer_full`: a bound the
    /// caller keeps elsewhere is reached (treated as the total being at its cap).
    pub fn admit(self: &Arc<Self>, ip: IpAddr, handle: H, outer_full: bool) -> Admit<H> {
        self.admit_at(ip, handle, outer_full, Instant::now())
    }

    fn admit_at(
        self: &Arc<Self>,
        ip: IpAddr,
        handle: H,
        outer_full: bool,
        now: Instant,
    ) -> Admit<H> {
        let addr = addr_key(ip);
        let l = self.limits;
        let mut g = self.lock();
        let held_here = g.by_addr.get(&addr).map_or(0, |a| a.held);
        let victim = if held_here >= l.per_addr {
            match g.by_addr.get(&addr).and_then(|a| a.idle.first().copied()) {
                Some((t, id)) if now.duration_since(t) >= l.protect => Some(id),
                _ => return Admit::No,
            }
        } else if outer_full || g.entries.len() >= l.total {
            match g.heaviest_idle_above(held_here) {
                Some(id) => Some(id),
                None => match g.idle.first().copied() {
                    Some((t, id)) if now.duration_since(t) >= l.protect => Some(id),
                    _ => return Admit::No,
                },
            }
        } else {
            None
        };
        let yielded = victim.and_then(|id| g.remove(id)).map(|e| e.handle);
        let id = g.next;
        g.next += 1;
        g.entries.insert(
            id,
            Entry {
                addr,
                busy: 0,
                since: now,
                handle,
            },
        );
        g.idle.insert((now, id));
        g.add_held(addr, 1);
        g.by_addr
            .get_mut(&addr)
            .expect("just counted")
            .idle
            .insert((now, id));
        drop(g);
        Admit::Yes {
            place: Place {
                places: self.clone(),
                id,
            },
            yielded,
        }
    }
}

impl<H> Inner<H> {
    /// The longest-idle entry among the addresses holding the most places (at least two
    /// more than `than`) that have an idle entry; among equally heavy ones the longest idle
    /// (looking at 64 addresses at most).
    fn heaviest_idle_above(&self, than: usize) -> Option<u64> {
        let mut best: Option<(usize, (Instant, u64))> = None;
        let heavy = self
            .heavy
            .iter()
            .rev()
            .take_while(|(held, _)| *held > than + 1);
        for (held, a) in heavy.take(64) {
            if best.is_some_and(|(h, _)| h > *held) {
                break; // every heavier address was looked at
            }
            let Some(&first) = self.by_addr.get(a).and_then(|a| a.idle.first()) else {
                continue;
            };
            if best.is_none_or(|(_, b)| first < b) {
                best = Some((*held, first));
            }
        }
        best.map(|(_, (_, id))| id)
    }

    fn add_held(&mut self, addr: IpAddr, delta: isize) {
        let a = self.by_addr.entry(addr).or_default();
        self.heavy.remove(&(a.held, addr));
        a.held = a.held.checked_add_signed(delta).expect("place counts");
        if a.held == 0 {
            self.by_addr.remove(&addr);
        } else {
            self.heavy.insert((a.held, addr));
        }
    }

    fn unidle(&mut self, id: u64) {
        let Some(e) = self.entries.get(&id) else {
            return;
        };
        if e.busy == 0 {
            let (since, addr) = (e.since, e.addr);
            self.idle.remove(&(since, id));
            if let Some(a) = self.by_addr.get_mut(&addr) {
                a.idle.remove(&(since, id));
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry<H>> {
        self.unidle(id);
        let e = self.entries.remove(&id)?;
        self.add_held(e.addr, -1);
        Some(e)
    }
}

/// A place held; dropping it frees the place (if it did not yield meanwhile).
pub struct Place<H> {
    places: Arc<Places<H>>,
    id: u64,
}

impl<H> Place<H> {
    /// Marks a request in progress: the entry may not yield until the guard is dropped (then
    /// it is idle from that moment). None: the entry has yielded already.
    pub fn busy(&self) -> Option<Busy<H>> {
        let mut g = self.places.lock();
        g.unidle(self.id);
        let e = g.entries.get_mut(&self.id)?;
        e.busy += 1;
        Some(Busy {
            places: self.places.clone(),
            id: self.id,
        })
    }

    /// Whether the place is still held (false: it yielded).
    pub fn is_held(&self) -> bool {
        self.places.lock().entries.contains_key(&self.id)
    }

    /// Leaves the set for good (a KV connection that authenticated): true if the place was
    /// still held (false: it had yielded and is being closed).
    pub fn release(self) -> bool {
        self.places.lock().remove(self.id).is_some()
    }
}

impl<H> Drop for Place<H> {
    fn drop(&mut self) {
        self.places.lock().remove(self.id);
    }
}

/// A request in progress on a place.
pub struct Busy<H> {
    places: Arc<Places<H>>,
    id: u64,
}

impl<H> Drop for Busy<H> {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut g = self.places.lock();
        let Some(e) = g.entries.get_mut(&self.id) else {
            return;
        };
        e.busy -= 1;
        if e.busy == 0 {
            e.since = now;
            let addr = e.addr;
            g.idle.insert((now, self.id));
            if let Some(a) = g.by_addr.get_mut(&addr) {
                a.idle.insert((now, self.id));
            }
        }
    }
}

#[cfg(test)]
mod tests;
