//! What a token costs in a pool: its main kinds' bytes, plus its window kinds' bytes for the
//! window pages the pool keeps beside its main pages ([`Share`]).

use strata_kv::PoolKind;

/// How many window pages a tier keeps for its main pages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Share {
    /// That many window pages per page (`--window-tokens-ratio`; 1: every page keeps its
    /// window state).
    Ratio(f64),
    /// `fixed` window pages (running requests' rings, sequence ends), plus `span` for every
    /// `k` main pages (checkpoints; `k` 0: none).
    Pages { fixed: u64, k: u64, span: u64 },
}

/// The cost of a token in a pool.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cost {
    pub(crate) main: u64,
    pub(crate) window: u64,
    pub(crate) share: Share,
    ps: u64,
}

impl Cost {
    pub(crate) fn new(kinds: &[PoolKind], share: Share, ps: u64) -> Cost {
        let by = |w: bool| {
            kinds
                .iter()
                .filter(|k| k.window.is_some() == w)
                .map(|k| k.bytes_per_token() as u64)
                .sum()
        };
        Cost {
            main: by(false),
            window: by(true),
            share,
            ps,
        }
    }

    /// The same kinds with another share.
    pub(crate) fn with(&self, share: Share) -> Cost {
        Cost { share, ..*self }
    }

    /// Bytes of one window page.
    pub(crate) fn window_page(&self) -> u64 {
        self.window * self.ps
    }

    /// Whole-page tokens whose window state a pool of `tokens` main tokens keeps.
    pub(crate) fn window_tokens(&self, tokens: u64) -> u64 {
        if self.window == 0 {
            return 0;
        }
        match self.share {
            Share::Ratio(r) if r >= 1.0 => tokens,
            Share::Ratio(r) => (tokens as f64 * r) as u64 / self.ps * self.ps,
            Share::Pages { fixed, k, span } => {
                let checkpoints = if k == 0 {
                    0
                } else {
                    (tokens / self.ps).div_ceil(k) * span
                };
                fixed.saturating_add(checkpoints).saturating_mul(self.ps)
            }
        }
    }

    /// Bytes of a pool of `tokens` main tokens (saturating: past 2^64 is past any machine).
    pub(crate) fn bytes(&self, tokens: u64) -> u64 {
        tokens
            .saturating_mul(self.main)
            .saturating_add(self.window_tokens(tokens).saturating_mul(self.window))
    }

    /// The most whole-page main tokens whose pool fits in `budget` bytes.
    pub(crate) fn tokens_for(&self, budget: u64) -> u64 {
        let ps = self.ps;
        let per = match self.share {
            _ if self.window == 0 => self.main as f64,
            Share::Ratio(r) if r >= 1.0 => (self.main + self.window) as f64,
            Share::Ratio(r) => self.main as f64 + self.window as f64 * r,
            Share::Pages { k: 0, .. } => self.main as f64,
            Share::Pages { k, span, .. } => {
                self.main as f64 + (span * self.window) as f64 / k as f64
            }
        };
        let fixed = self.bytes(0);
        if fixed >= budget || per == 0.0 {
            return 0;
        }
        let mut t = ((budget - fixed) as f64 / per) as u64 / ps * ps;
        while t > 0 && self.bytes(t) > budget {
            t -= ps;
        }
        // A share rounded down per page may leave room for a few more.
        while self.bytes(t + ps) <= budget {
            t += ps;
        }
        t
    }

    /// Bytes per main token of a large pool, rounded up (for messages).
    pub(crate) fn per_token(&self) -> u64 {
        let n = 1u64 << 30;
        (self.bytes(n) - self.bytes(0)).div_ceil(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(share: Share) -> Cost {
        let kinds = [
            PoolKind::aux("main", 1, 10),
            PoolKind::aux("raw", 1, 100).with_window(8),
        ];
        Cost::new(&kinds, share, 4)
    }

    #[test]
    fn every_share_fits_its_budget_and_one_more_page_would_not() {
        for share in [
            Share::Ratio(1.0),
            Share::Ratio(0.3),
            Share::Pages {
                fixed: 0,
                k: 0,
                span: 0,
            },
            Share::Pages {
                fixed: 7,
                k: 5,
                span: 2,
            },
        ] {
            let c = cost(share);
            for budget in [0u64, 1, 999, 10_000, 123_457, 10_000_000] {
                let t = c.tokens_for(budget);
                assert_eq!(t % 4, 0);
                assert!(c.bytes(t) <= budget || t == 0, "{share:?} {budget}");
                if t > 0 || c.bytes(0) < budget {
                    assert!(c.bytes(t + 4) > budget, "{share:?} {budget}: {t}");
                }
            }
        }
    }

    #[test]
    fn checkpoints_cost_their_span_every_k_pages_on_top_of_the_fixed_pages() {
        let c = cost(Share::Pages {
            fixed: 3,
            k: 10,
            span: 2,
        });
        // 100 pages: 10 checkpoints of 2 pages, 3 fixed.
        assert_eq!(c.window_tokens(400), (3 + 20) * 4);
        assert_eq!(c.window_tokens(404), (3 + 22) * 4);
        assert_eq!(c.bytes(0), 3 * 4 * 100);
    }
}
