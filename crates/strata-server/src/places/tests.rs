use std::net::{IpAddr, Ipv4Addr};

use proptest::prelude::*;

use super::*;

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

fn limits(total: usize, per_addr: usize) -> PlaceLimits {
    PlaceLimits {
        total,
        per_addr,
        protect: Duration::from_secs(1),
    }
}

/// Admits at `t`; (place, what yielded) or None.
fn admit(p: &Arc<Places<u32>>, from: u8, h: u32, t: Instant) -> Option<(Place<u32>, Option<u32>)> {
    match p.admit_at(ip(from), h, false, t) {
        Admit::Yes { place, yielded } => Some((place, yielded)),
        Admit::No => None,
    }
}

#[test]
fn an_address_at_its_cap_yields_its_own_oldest_idle_entry_after_the_protection() {
    let p = Places::new(limits(100, 2));
    let t0 = Instant::now();
    let _a = admit(&p, 1, 1, t0).unwrap();
    let _b = admit(&p, 1, 2, t0 + Duration::from_millis(10)).unwrap();
    // Both still protected: the newcomer from the same address is refused.
    assert!(admit(&p, 1, 3, t0 + Duration::from_millis(500)).is_none());
    // The oldest has been idle for a second: it yields.
    let (_c, y) = admit(&p, 1, 3, t0 + Duration::from_millis(1000)).unwrap();
    assert_eq!(y, Some(1));
    assert_eq!(p.held(), 2);
}

#[test]
fn an_address_below_the_heaviest_always_gets_in_when_the_total_is_full() {
    let p = Places::new(limits(8, 4));
    let t0 = Instant::now();
    // Two strangers hold all 8 places, all fresh.
    let held: Vec<_> = (0..8)
        .map(|i| admit(&p, 2 + (i % 2) as u8, i, t0).unwrap())
        .collect();
    // A newcomer from a third address takes the oldest place of a heaviest address at once.
    let (newcomer, y) = admit(&p, 1, 100, t0).unwrap();
    assert!(matches!(y, Some(0) | Some(1)), "{y:?}");
    // The strangers churning cannot push it out: their addresses hold more than its one.
    let mut churn = Vec::new();
    for i in 0..50 {
        if let Some((pl, _)) = admit(&p, 2 + (i % 2) as u8, 200 + i as u32, t0) {
            churn.push(pl);
        }
    }
    assert!(newcomer.busy().is_some(), "the newcomer was pushed out");
    assert_eq!(p.held(), 8);
    drop(held);
}

#[test]
fn equal_shares_do_not_push_out_fresh_entries_and_ties_go_to_the_longest_idle() {
    let p = Places::new(limits(3, 4));
    let t0 = Instant::now();
    // Three addresses with one place each, all fresh: a fourth address is refused (no
    // address holds two more than it), not given a place still completing its first exchange.
    let _held: Vec<_> = (0..3)
        .map(|i| admit(&p, 2 + i, i as u32, t0).unwrap())
        .collect();
    assert!(admit(&p, 9, 9, t0 + Duration::from_millis(10)).is_none());
    // Two equally heavy addresses: the longest-idle entry of the two yields, whichever
    // address sorts higher.
    let p = Places::new(limits(4, 4));
    let (_a1, _) = admit(&p, 7, 71, t0 + Duration::from_millis(5)).unwrap();
    let (_b1, _) = admit(&p, 3, 31, t0).unwrap();
    let (_a2, _) = admit(&p, 7, 72, t0 + Duration::from_millis(6)).unwrap();
    let (_b2, _) = admit(&p, 3, 32, t0 + Duration::from_millis(7)).unwrap();
    let (_n, y) = admit(&p, 1, 100, t0 + Duration::from_millis(8)).unwrap();
    assert_eq!(y, Some(31));
}

#[test]
fn busy_entries_never_yield_and_idle_again_counts_from_the_end_of_the_request() {
    let p = Places::new(limits(2, 2));
    let t0 = Instant::now() - Duration::from_secs(10);
    let (a, _) = admit(&p, 1, 1, t0).unwrap();
    let (b, _) = admit(&p, 1, 2, t0).unwrap();
    let ba = a.busy().unwrap();
    let bb = b.busy().unwrap();
    assert!(
        admit(&p, 1, 3, Instant::now()).is_none(),
        "a busy entry yielded"
    );
    assert!(
        admit(&p, 2, 3, Instant::now()).is_none(),
        "a busy entry yielded"
    );
    drop(ba);
    // `a` is idle since now: protected against its own address for a second...
    assert!(admit(&p, 1, 3, Instant::now()).is_none());
    drop(bb);
}

#[test]
fn a_yielded_place_is_gone_for_its_holder() {
    let p = Places::new(limits(1, 1));
    let t0 = Instant::now() - Duration::from_secs(5);
    let (a, _) = admit(&p, 1, 1, t0).unwrap();
    let (b, y) = admit(&p, 1, 2, Instant::now()).unwrap();
    assert_eq!(y, Some(1));
    assert!(a.busy().is_none());
    assert!(!a.release());
    assert!(b.release());
    assert_eq!(p.held(), 0);
}

#[test]
fn ipv6_counts_by_64_and_mapped_ipv4_as_ipv4() {
    let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
    let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
    assert_eq!(addr_key(a), addr_key(b));
    let m: IpAddr = "::ffff:127.0.0.5".parse().unwrap();
    assert_eq!(addr_key(m), ip(5));
}

/// (place, its request if busy, address, handle)
type Live = (Place<u32>, Option<Busy<u32>>, u8, u32);

#[derive(Clone, Debug)]
enum Op {
    Admit { from: u8, at_ms: u64 },
    Drop(usize),
    Busy(usize),
    Idle(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..5, 0u64..3000).prop_map(|(from, at_ms)| Op::Admit { from, at_ms }),
        1 => any::<usize>().prop_map(Op::Drop),
        1 => any::<usize>().prop_map(Op::Busy),
        1 => any::<usize>().prop_map(Op::Idle),
    ]
}

proptest! {
    /// Bounds hold whatever happens; a busy entry never yields; a newcomer from an address
    /// holding two places fewer than some other address with an idle entry is always
    /// admitted.
    #[test]
    fn bounds_hold_and_the_rules_are_kept(
        total in 1usize..10,
        per in 1usize..5,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let p = Places::new(limits(total, per));
        let base = Instant::now();
        // (place, its request if busy, address, handle)
        let mut live: Vec<Live> = Vec::new();
        let mut clock = 0u64;
        for (n, o) in ops.into_iter().enumerate() {
            match o {
                Op::Admit { from, at_ms } => {
                    clock = clock.max(at_ms);
                    let now = base + Duration::from_millis(clock);
                    let count = |f: u8, live: &[Live]| {
                        live.iter().filter(|x| x.2 == f).count()
                    };
                    let mine = count(from, &live);
                    let below_other_with_idle = mine < per
                        && live.iter().any(|x| x.1.is_none() && count(x.2, &live) > mine + 1);
                    match p.admit_at(ip(from), n as u32, false, now) {
                        Admit::Yes { place, yielded } => {
                            if let Some(y) = yielded {
                                let i = live.iter().position(|x| x.3 == y).expect("a live entry yielded");
                                prop_assert!(live[i].1.is_none(), "a busy entry yielded");
                                live.remove(i);
                            }
                            live.push((place, None, from, n as u32));
                        }
                        Admit::No => {
                            prop_assert!(
                                !below_other_with_idle || mine >= per,
                                "an address below another's share was refused"
                            );
                        }
                    }
                }
                Op::Drop(i) if !live.is_empty() => {
                    live.remove(i % live.len());
                }
                Op::Busy(i) if !live.is_empty() => {
                    let k = i % live.len();
                    if live[k].1.is_none() {
                        live[k].1 = live[k].0.busy();
                        prop_assert!(live[k].1.is_some());
                    }
                }
                Op::Idle(i) if !live.is_empty() => {
                    let k = i % live.len();
                    live[k].1 = None;
                }
                _ => {}
            }
            prop_assert_eq!(p.held(), live.len());
            prop_assert!(live.len() <= total);
            for f in 0u8..5 {
                prop_assert!(live.iter().filter(|x| x.2 == f).count() <= per);
            }
        }
    }
}
