//! What a token costs in a pool when window kinds keep their state for only a share of the
//! tokens (`--window-tokens-ratio`), and the plan's line about it.

use strata_kv::PoolKind;

use super::{Decision, PlanError, PlanRequest};

/// The cost of a token in a pool: its main kinds' bytes, and its window kinds' bytes for the
/// share of tokens that keep their window state (`--window-tokens-ratio`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cost {
    main: u64,
    pub(crate) window: u64,
    pub(crate) ratio: f64,
    ps: u64,
}

impl Cost {
    pub(crate) fn new(kinds: &[PoolKind], ratio: f64, ps: u64) -> Cost {
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
            ratio,
            ps,
        }
    }

    /// Whole-page tokens whose window state a pool of `tokens` tokens keeps.
    pub(crate) fn window_tokens(&self, tokens: u64) -> u64 {
        if self.window == 0 {
            0
        } else if self.ratio >= 1.0 {
            tokens
        } else {
            (tokens as f64 * self.ratio) as u64 / self.ps * self.ps
        }
    }

    /// Bytes of a pool of `tokens` tokens.
    pub(crate) fn bytes(&self, tokens: u64) -> u64 {
        tokens * self.main + self.window_tokens(tokens) * self.window
    }

    /// The most whole-page tokens whose pool fits in `budget` bytes.
    pub(crate) fn tokens_for(&self, budget: u64) -> u64 {
        let ps = self.ps;
        if self.window == 0 || self.ratio >= 1.0 {
            return budget / (self.main + self.window) / ps * ps;
        }
        let per = self.main as f64 + self.window as f64 * self.ratio;
        let mut t = (budget as f64 / per) as u64 / ps * ps;
        while t > 0 && self.bytes(t) > budget {
            t -= ps;
        }
        t
    }

    /// Bytes per token at this ratio, rounded up (for messages).
    pub(crate) fn per_token(&self) -> u64 {
        self.bytes(1 << 20).div_ceil(1 << 20)
    }
}

/// States how many tokens keep their window state; refuses a ratio that leaves no window page
/// on device (a request computes into one per page), or one given for a model without window
/// kinds. (The ratio's range was validated with the request.)
pub(crate) fn window_decisions(
    req: &PlanRequest,
    cost: &Cost,
    device_tokens: u64,
    device_window: u64,
    decided: &mut Vec<Decision>,
) -> Result<(), PlanError> {
    let r = cost.ratio;
    if cost.window == 0 {
        return match req.window_ratio {
            Some(ratio) => Err(PlanError::NoWindowKinds {
                ratio,
                model: req.model.name.clone(),
            }),
            None => Ok(()),
        };
    }
    if device_window == 0 {
        return Err(PlanError::NoWindowPage {
            ratio: r,
            tokens: (device_tokens as f64 * r) as u64,
            page_size: req.page_size,
        });
    }
    let by = match req.window_ratio {
        Some(r) => format!(
            "--window-tokens-ratio {r}: window kinds (read only for the last tokens before a continuation) in {device_window} of the {device_tokens} device tokens per rank, the same share on host; the longest request is {device_window} tokens"
        ),
        None => "no --window-tokens-ratio: every page keeps its window kinds (ratio 1)".into(),
    };
    decided.push(Decision {
        what: "window kinds' tokens per rank".into(),
        by,
    });
    Ok(())
}

/// How the kinds share the tokens (several kinds only).
pub(crate) fn kinds_decision(cost: &Cost, n: usize, ps: u64, decided: &mut Vec<Decision>) {
    if n > 1 {
        let by = if cost.window > 0 {
            format!("--page-size {ps}: a page holds every main kind (block kinds packed per page) and a window page every window kind, so each kind gets its class's tokens above at its bytes/token, inside the same budgets")
        } else {
            format!("--page-size {ps}: one page holds every kind (block kinds packed per page), so each kind gets the tokens above at its bytes/token, inside the same budgets")
        };
        decided.push(Decision {
            what: format!("each of the {} pool kinds' tokens per rank", n),
            by,
        });
    }
}
