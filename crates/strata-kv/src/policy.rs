//! Write and eviction policies.

/// When device pages are copied to the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// Back up every inserted node at once.
    WriteThrough,
    /// Back up a node once its hit count reaches the threshold.
    WriteThroughSelective { threshold: u32 },
    /// Copy to host only when the node is evicted from the device.
    WriteBack,
}

impl WritePolicy {
    /// Parses `write_through`, `write_through_selective[:N]` (default N = 2; N ≤ 65,535, the
    /// most hits a node counts) or `write_back`.
    pub fn parse(s: &str) -> Option<WritePolicy> {
        match s {
            "write_through" => Some(WritePolicy::WriteThrough),
            "write_back" => Some(WritePolicy::WriteBack),
            "write_through_selective" => Some(WritePolicy::WriteThroughSelective { threshold: 2 }),
            _ => {
                let n: u16 = s.strip_prefix("write_through_selective:")?.parse().ok()?;
                if n == 0 {
                    return None; // backed up once hit 0 times: write_through, said as such
                }
                Some(WritePolicy::WriteThroughSelective {
                    threshold: n as u32,
                })
            }
        }
    }
}

/// How long admission waits for pages being prefetched from L3 into the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchPolicy {
    /// Do not wait: compute what has not arrived (the prefetch still lands for later requests).
    BestEffort,
    /// Wait until the prefetch completes.
    WaitComplete,
    /// Wait at most this long per prefetched token, then compute the rest.
    Timeout { per_token: std::time::Duration },
}

/// Which evictable leaf goes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used leaf.
    Lru,
    /// Greedy-Dual-Size-Frequency over equal-size pages: priority = L + frequency, where L rises
    /// to each victim's priority (so idle entries age out) and the frequency of an evicted node
    /// is remembered in a bounded history (under the key of where it started), so a prefix that
    /// keeps coming back is recognised even after it was pushed out. Beats LRU when reuse
    /// distances exceed the cache.
    Gdsf,
    /// SIEVE (Zhang et al., NSDI '24): leaves in insertion order, a hit only sets a visited
    /// bit, and a hand sweeps from the oldest towards the newest, clearing visited bits and
    /// evicting the first leaf without one; survivors keep their place. No reordering on a hit.
    Sieve,
    /// S3-FIFO (Yang et al., SOSP '23): a small queue for new nodes (a tenth of the tier), a
    /// main queue for nodes hit while small or remembered in a ghost of evicted nodes, 2-bit
    /// frequencies and reinsertion instead of reordering.
    S3Fifo,
    /// The default: GDSF where a leaf new to the history starts on probation, with a credit
    /// below one access learnt online from which removed nodes come back (those removed on
    /// probation against the others, as ARC balances its lists): one-off continuations go
    /// first when they never return, newcomers are kept like GDSF's when they do (see
    /// `tree/auto.rs`).
    Auto,
}

impl EvictionPolicy {
    /// Every policy, in the order reports list them.
    pub const ALL: [EvictionPolicy; 5] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Gdsf,
        EvictionPolicy::Sieve,
        EvictionPolicy::S3Fifo,
        EvictionPolicy::Auto,
    ];

    /// What a cache runs when nobody chose.
    pub const DEFAULT: EvictionPolicy = EvictionPolicy::Auto;

    /// Whether the policy keeps a history of evicted nodes (keyed where each started).
    pub fn has_history(&self) -> bool {
        matches!(
            self,
            EvictionPolicy::Gdsf | EvictionPolicy::S3Fifo | EvictionPolicy::Auto
        )
    }

    /// Whether the policy orders leaves by GDSF's priority (GDSF and `auto`).
    pub fn is_gdsf(&self) -> bool {
        matches!(self, EvictionPolicy::Gdsf | EvictionPolicy::Auto)
    }

    pub fn parse(s: &str) -> Option<EvictionPolicy> {
        match s {
            "lru" => Some(EvictionPolicy::Lru),
            "gdsf" => Some(EvictionPolicy::Gdsf),
            "sieve" => Some(EvictionPolicy::Sieve),
            "s3fifo" => Some(EvictionPolicy::S3Fifo),
            "auto" => Some(EvictionPolicy::Auto),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Gdsf => "gdsf",
            EvictionPolicy::Sieve => "sieve",
            EvictionPolicy::S3Fifo => "s3fifo",
            EvictionPolicy::Auto => "auto",
        }
    }
}

/// Access counts of nodes no longer cached, kept approximately in a table of fixed size: a
/// count-min sketch of two rows of four-bit counters (both rows' counters of one index share a
/// byte: one byte per key) with conservative (max) update, so a remembered count is never below
/// what was recorded since the last halving (in its encoding), and above it only where both of
/// a key's cells collide with other keys'. Every [`AGING`] × `width` records all counts halve,
/// so old popularity fades. No allocation after construction, two cells touched per call.
#[derive(Debug)]
pub struct FrequencyHistory {
    /// `width` bytes: row 0's counter in the low four bits, row 1's in the high four.
    cells: Vec<u8>,
    /// Counters per row.
    width: usize,
    since_aging: usize,
}

/// Multipliers of the two rows' multiply-shift hashes (odd, from the golden ratio and π).
const ROW_MUL: [u64; 2] = [0x9E37_79B9_7F4A_7C15, 0x243F_6A88_85A3_08D3 | 1];

/// Counts up to [`LINEAR`] are kept exactly; above, in doublings (read back rounded down to
/// `7 × 2^k`, within a factor of 2), up to 1,792: a hot shared prefix that comes back keeps a
/// weight far above a one-off's.
const LINEAR: u32 = 7;
const TOP: u8 = 15;

fn encode(count: u32) -> u8 {
    if count <= LINEAR {
        return count as u8;
    }
    let k = (count / LINEAR).ilog2();
    (LINEAR + k).min(TOP as u32) as u8
}

fn decode(code: u8) -> u32 {
    if code as u32 <= LINEAR {
        return code as u32;
    }
    LINEAR << (code as u32 - LINEAR)
}

/// A code of half the count.
fn halve(code: u8) -> u8 {
    if code as u32 <= LINEAR {
        code / 2
    } else {
        code - 1
    }
}

/// Counts halve every this many row widths of records (a row is then at most about half
/// full: a key never recorded reads as seen in at most ~15 % of lookups).
const AGING: usize = 1;

impl Default for FrequencyHistory {
    fn default() -> FrequencyHistory {
        FrequencyHistory::new(16)
    }
}

impl FrequencyHistory {
    /// A history for `cap` keys (16 to 2^28): two rows of `cap` four-bit counters, one byte per
    /// key.
    pub fn new(cap: usize) -> FrequencyHistory {
        let width = cap.clamp(16, 1 << 28);
        FrequencyHistory {
            cells: vec![0; width],
            width,
            since_aging: 0,
        }
    }

    fn width(&self) -> usize {
        self.width
    }

    /// The key's counter index in each row: the high half of a multiply-shift hash scaled to
    /// the width (any width, not only powers of two).
    fn cells_of(&self, key: u64) -> [usize; 2] {
        let w = self.width;
        let at = |r: usize| ((key.wrapping_mul(ROW_MUL[r]) as u128 * w as u128) >> 64) as usize;
        [at(0), at(1)]
    }

    fn get(&self, row: usize, i: usize) -> u8 {
        self.cells[i] >> (4 * row) & 0xF
    }

    /// Remembers `count` for `key` (exact to 7, then within a factor of 2, up to 1,792; see
    /// [`encode`]).
    pub fn record(&mut self, key: u64, count: u32) {
        let c = encode(count);
        for (row, i) in self.cells_of(key).into_iter().enumerate() {
            let v = self.get(row, i).max(c);
            let shift = 4 * row;
            self.cells[i] = (self.cells[i] & !(0xF << shift)) | v << shift;
        }
        self.since_aging += 1;
        if self.since_aging >= AGING * self.width() {
            self.since_aging = 0;
            for v in &mut self.cells {
                *v = halve(*v & 0xF) | halve(*v >> 4) << 4;
            }
        }
    }

    /// The remembered count of `key` (0 when unknown).
    pub fn take(&mut self, key: u64) -> u32 {
        let [a, b] = self.cells_of(key);
        decode(self.get(0, a).min(self.get(1, b)))
    }

    /// Heap bytes of the table.
    pub fn bytes(&self) -> usize {
        self.cells.len()
    }
}

/// One access in an `auto` node's fixed-point frequency.
pub const UNIT: u32 = 20;
/// The newcomer's credit: where it starts, its bounds, and its step (a twentieth of an access).
const START: u32 = UNIT / 2;
const LO: u32 = UNIT / 4;
const HI: u32 = UNIT;
const STEP: u32 = 1;
/// What each window keeps of the counts before it.
const DECAY: f64 = 0.9;
/// The fewest removed pages in a window.
const MIN_WINDOW: usize = 64;

/// `auto`'s credit for newcomers (see `tree/auto.rs`): the fixed-point frequency a leaf new to
/// the eviction history starts with, learnt ARC-style from which removed pages come back soon.
/// Removed nodes are remembered for about one cache of removed pages in two ghosts (removed on
/// probation, or not), whose generations advance together on every removed page, so both
/// remember the same stretch of removals; over each window of removed pages (an eighth of the
/// cache), if pages removed on probation came back more often per removed page than the
/// others, the credit rises a step, else it falls one, within [0.25, 1] access. A key found in
/// both ghosts (a collision, or a key removed twice in different states) counts for neither.
#[derive(Debug)]
pub struct Newcomers {
    /// Fixed-point frequency of a leaf the history does not know.
    credit: u32,
    /// Keys of nodes removed lately, [on probation, otherwise].
    ghosts: [Ghost; 2],
    /// Pages removed into the ghosts' current generation, and how many fill one.
    generation: usize,
    span: usize,
    /// Pages removed, and pages that came back while their key was in a ghost, [on
    /// probation, otherwise] (decayed).
    removed: [f64; 2],
    returned: [f64; 2],
    /// Pages removed since the credit last moved, and how many move it.
    since: usize,
    window: usize,
    /// Pages removed and returned since the start, [on probation, otherwise] (not decayed).
    removed_total: [u64; 2],
    returned_total: [u64; 2],
}

impl Newcomers {
    /// State for a cache of `cap` pages.
    pub fn new(cap: usize) -> Newcomers {
        let span = (cap / 2).max(1);
        Newcomers {
            credit: START,
            ghosts: [Ghost::new(span), Ghost::new(span)],
            generation: 0,
            span,
            removed: [1.0; 2],
            returned: [0.0; 2],
            since: 0,
            window: (cap / 8).max(MIN_WINDOW),
            removed_total: [0; 2],
            returned_total: [0; 2],
        }
    }

    /// The credit and the evidence it was learnt from, since the start.
    pub fn learning(&self) -> crate::stats::AutoLearning {
        crate::stats::AutoLearning {
            newcomer_credit: self.credit as f64 / UNIT as f64,
            probation_removed_pages: self.removed_total[0],
            probation_returned_pages: self.returned_total[0],
            used_removed_pages: self.removed_total[1],
            used_returned_pages: self.returned_total[1],
        }
    }

    pub fn bytes(&self) -> usize {
        self.ghosts[0].bytes() + self.ghosts[1].bytes()
    }

    /// The fixed-point frequency a newcomer starts with ([`UNIT`]: one access).
    pub fn credit(&self) -> u32 {
        self.credit
    }

    /// A new leaf under `key` with `pages` pages: a return if a ghost remembers the key.
    pub fn returned(&mut self, key: u64, pages: usize) {
        let k = match [0, 1].map(|k| self.ghosts[k].contains(key)) {
            [true, false] => 0,
            [false, true] => 1,
            _ => return,
        };
        self.returned[k] += pages as f64;
        self.returned_total[k] += pages as u64;
    }

    /// `pages` pages under `key` left the cache, `probation` if they never earned an access.
    pub fn removed(&mut self, key: u64, probation: bool, pages: usize) {
        let k = usize::from(!probation);
        self.ghosts[k].insert(key);
        self.removed[k] += pages as f64;
        self.removed_total[k] += pages as u64;
        self.generation += pages;
        if self.generation >= self.span {
            self.generation = 0;
            self.ghosts.iter_mut().for_each(Ghost::advance);
        }
        self.since += pages;
        if self.since >= self.window {
            self.adapt();
        }
    }

    /// Moves the credit once a window of pages has been removed.
    fn adapt(&mut self) {
        self.since = 0;
        // At least one page below the rate: a class with no removals for long reads 0, never
        // NaN or infinite.
        let rate = |k: usize| self.returned[k] / self.removed[k].max(1.0);
        self.credit = if rate(0) > rate(1) {
            (self.credit + STEP).min(HI)
        } else {
            self.credit.saturating_sub(STEP).max(LO)
        };
        for k in 0..2 {
            self.removed[k] *= DECAY;
            self.returned[k] *= DECAY;
        }
    }
}

/// Bloom bits per key a ghost generation has room for: 1.4 % false positives full, so a
/// lookup in two full generations errs 3 % of the time.
const GHOST_BITS: usize = 16;
/// The ghosts' hash multipliers, apart from the history's so their collisions are unrelated.
const GHOST_MUL: [u64; 2] = [0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9 | 1];

/// Keys of nodes removed lately: two generations of a Bloom filter of two bits a key;
/// [`Newcomers`] advances the generations every `span` removed pages (the older is cleared and
/// takes the keys from then on). A key is remembered while its node is among the last `span`
/// to `2 · span` removed pages (`span` half a cache: the horizon in which keeping it would have
/// been a hit, as ARC's ghost lists are one cache long). A generation starts with
/// [`GHOST_BITS`] bits for each key the one before it took (for `span` keys, a page each, at
/// first): nodes of many pages (page size 1, long prompts) cost a fraction of a bit a page.
#[derive(Debug)]
struct Ghost {
    bits: [Vec<u64>; 2],
    /// Which generation takes keys now, and how many it has taken.
    current: usize,
    keys: usize,
}

impl Ghost {
    fn new(span: usize) -> Ghost {
        let g = || vec![0; Ghost::words(span)];
        Ghost {
            bits: [g(), g()],
            current: 0,
            keys: 0,
        }
    }

    /// Words of a generation with room for `keys` keys.
    fn words(keys: usize) -> usize {
        keys.saturating_mul(GHOST_BITS).clamp(64, 1 << 32) / 64
    }

    fn positions(key: u64, width: usize) -> [usize; 2] {
        GHOST_MUL.map(|m| ((key.wrapping_mul(m) as u128 * width as u128) >> 64) as usize)
    }

    fn insert(&mut self, key: u64) {
        let g = &mut self.bits[self.current];
        for b in Ghost::positions(key, g.len() * 64) {
            g[b / 64] |= 1 << (b % 64);
        }
        self.keys += 1;
    }

    /// The older generation is forgotten, sized for as many keys as the current one took,
    /// and takes the keys from now on.
    fn advance(&mut self) {
        self.current ^= 1;
        let g = &mut self.bits[self.current];
        g.clear();
        g.resize(Ghost::words(self.keys), 0);
        g.shrink_to_fit();
        self.keys = 0;
    }

    fn contains(&self, key: u64) -> bool {
        self.bits.iter().any(|g| {
            Ghost::positions(key, g.len() * 64)
                .iter()
                .all(|&b| g[b / 64] >> (b % 64) & 1 == 1)
        })
    }

    fn bytes(&self) -> usize {
        (self.bits[0].len() + self.bits[1].len()) * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_policies() {
        assert_eq!(
            WritePolicy::parse("write_back"),
            Some(WritePolicy::WriteBack)
        );
        assert_eq!(
            WritePolicy::parse("write_through_selective:3"),
            Some(WritePolicy::WriteThroughSelective { threshold: 3 })
        );
        assert_eq!(WritePolicy::parse("write_sideways"), None);
        assert_eq!(WritePolicy::parse("write_through_selective:65536"), None);
        assert_eq!(EvictionPolicy::parse("gdsf"), Some(EvictionPolicy::Gdsf));
        assert_eq!(EvictionPolicy::parse("mru"), None);
    }

    #[test]
    fn the_credit_follows_which_removed_pages_come_back() {
        let mut a = Newcomers::new(800);
        assert_eq!((a.credit(), a.window), (START, 100));
        // Pages removed on probation come back (per page) more than the others: newcomers
        // deserve more credit.
        for k in 0..6u64 {
            a.removed(k, true, 50);
            a.returned(k, 50);
            a.removed(1000 + k, false, 50);
        }
        assert_eq!(a.credit(), START + 6 * STEP);
        let l = a.learning();
        assert_eq!(l.newcomer_credit, (START + 6 * STEP) as f64 / UNIT as f64);
        assert_eq!(
            [l.probation_removed_pages, l.probation_returned_pages],
            [300, 300]
        );
        assert_eq!([l.used_removed_pages, l.used_returned_pages], [300, 0]);
        // Pages that earned their place come back, newcomers removed on probation never do.
        for k in 0..1000u64 {
            a.removed(2000 + k, true, 50);
            a.removed(1_000_000 + k, false, 50);
            a.returned(1_000_000 + k, 50);
        }
        assert_eq!(a.credit(), LO, "the credit falls to its floor");
        // The other way round: newcomers come back, the rest does not.
        for k in 0..1000u64 {
            a.removed(5000 + k, true, 50);
            a.returned(5000 + k, 50);
            a.removed(2_000_000 + k, false, 50);
        }
        assert_eq!(a.credit(), HI);
        assert_eq!(a.learning().newcomer_credit, 1.0);
        assert_eq!(a.learning().used_removed_pages, 300 + 2 * 50_000);
        assert_eq!(Newcomers::new(10).window, MIN_WINDOW);
    }

    #[test]
    fn the_ghosts_remember_about_one_cache_of_removed_pages() {
        let mut a = Newcomers::new(4096);
        assert_eq!(a.bytes(), 16384, "four bytes a cached page at first");
        // Nodes of 8 pages, every other one on probation: a generation takes 256 of them.
        let g = |a: &Newcomers, k: u64| a.ghosts[usize::from(k % 2 == 1)].contains(k);
        for k in 0..250u64 {
            a.removed(k, k % 2 == 0, 8);
        }
        assert!((0..250).all(|k| g(&a, k)));
        let strangers = (10_000..20_000u64)
            .filter(|&k| a.ghosts.iter().any(|g| g.contains(k)))
            .count();
        assert!(strangers < 50, "{strangers} false positives of 10,000");
        for k in 250..620u64 {
            a.removed(k, k % 2 == 0, 8);
        }
        // The current generation and the one before: the last 1 to 2 spans of pages.
        assert!((256..620).all(|k| g(&a, k)), "the last cache of pages");
        let old = (0..250u64).filter(|&k| g(&a, k)).count();
        assert!(old < 20, "{old} of 250 keys older than a cache still seen");
        // Generations are sized by the keys they take: 128 keys of 8 pages a generation.
        assert_eq!(
            a.bytes(),
            4 * 128 * GHOST_BITS / 8,
            "a fraction of a byte a page"
        );
        // Probation alone from here on: the other ghost forgets as fast, and shrinks.
        for k in 620..1300u64 {
            a.removed(k * 2, true, 8);
        }
        assert_eq!((256..620u64).filter(|&k| k % 2 == 1 && g(&a, k)).count(), 0);
        assert_eq!(
            a.ghosts[1].bytes(),
            2 * 8,
            "an empty ghost keeps a word a generation"
        );
    }

    #[test]
    fn a_key_in_both_ghosts_counts_for_neither() {
        let mut a = Newcomers::new(800);
        a.removed(7, true, 1);
        a.removed(7, false, 1);
        a.returned(7, 5);
        assert_eq!(a.returned, [0.0, 0.0]);
        a.removed(8, false, 1);
        a.returned(8, 5);
        assert_eq!(a.returned, [0.0, 5.0]);
        let l = a.learning();
        assert_eq!([l.probation_returned_pages, l.used_returned_pages], [0, 5]);
        assert_eq!([l.probation_removed_pages, l.used_removed_pages], [1, 2]);
    }

    #[test]
    fn history_is_bounded_and_ages() {
        let mut h = FrequencyHistory::new(1024);
        assert_eq!(h.bytes(), 1024);
        for k in 0..100u64 {
            h.record(k, if k < 8 { 100 } else { 1 });
        }
        // Never below what was recorded (in the encoding: 100 reads as 56); no unrecorded key
        // of 200 looks frequent.
        for k in 0..8 {
            assert!(h.take(k) >= 56, "frequent page {k} forgotten");
        }
        assert!((8..100).all(|k| h.take(k) >= 1));
        assert!((1000..1200).filter(|&k| h.take(k) > 1).count() <= 2);
        assert_eq!(h.take(5000), 0);
        // Large counts are kept within a factor of 2, up to 1,792; every AGING × width records
        // they halve.
        h.record(7, 1000);
        assert_eq!(h.take(7), 896);
        h.record(9, 1_000_000);
        assert_eq!(h.take(9), 1792);
        for k in 0..(AGING * 1024) as u64 {
            h.record(10_000 + k, 1);
        }
        assert_eq!(h.take(7), 448, "no aging");
        assert!(h.take(3) >= 28 && h.take(3) <= 56);
    }

    #[test]
    fn rows_of_any_width_reach_every_cell() {
        let mut h = FrequencyHistory::new(1000);
        assert_eq!(h.bytes(), 1000);
        let mut seen = vec![false; 2000];
        for k in 0..20_000u64 {
            for (row, c) in h
                .cells_of(k.wrapping_mul(0x2545_F491_4F6C_DD1D))
                .into_iter()
                .enumerate()
            {
                seen[row * 1000 + c] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "some cell is never used");
        h.record(42, 5);
        assert_eq!(h.take(42), 5);
    }

    #[test]
    fn the_count_encoding_is_monotone_and_exact_up_to_7() {
        let mut last = 0;
        for c in 0..100_000u32 {
            let code = encode(c);
            assert!(code >= last && code <= TOP);
            last = code;
            let d = decode(code);
            if c <= 7 {
                assert_eq!(d, c);
            } else if c < 3584 {
                assert!(d <= c && d * 2 > c, "{c} → {d}");
            }
        }
        assert_eq!(halve(encode(6)), encode(3));
        assert_eq!(decode(halve(encode(2000))), 896);
        assert_eq!(halve(encode(8)), encode(3));
    }
}
