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
}

impl EvictionPolicy {
    /// Every policy, in the order reports list them.
    pub const ALL: [EvictionPolicy; 4] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Gdsf,
        EvictionPolicy::Sieve,
        EvictionPolicy::S3Fifo,
    ];

    /// Whether the policy keeps a history of evicted nodes (keyed where each started).
    pub fn has_history(&self) -> bool {
        matches!(self, EvictionPolicy::Gdsf | EvictionPolicy::S3Fifo)
    }

    pub fn parse(s: &str) -> Option<EvictionPolicy> {
        match s {
            "lru" => Some(EvictionPolicy::Lru),
            "gdsf" => Some(EvictionPolicy::Gdsf),
            "sieve" => Some(EvictionPolicy::Sieve),
            "s3fifo" => Some(EvictionPolicy::S3Fifo),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Gdsf => "gdsf",
            EvictionPolicy::Sieve => "sieve",
            EvictionPolicy::S3Fifo => "s3fifo",
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
